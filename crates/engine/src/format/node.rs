//! Map node v2 (4128 bytes raw; stored as record header ‖ lz4(raw), never encrypted).
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 4 | `BWN2` |
//! | 4 | 1 | level |
//! | 5 | 3 | zero |
//! | 8 | 8 | node index |
//! | 16 | 4 | lineage id |
//! | 20 | 4 | zero |
//! | 24 | 8 | birth (equal to the parent pointer's birth) |
//! | 32 | 64 × 64 | child pointers (or segment entries in a segment-table leaf) |
//!
//! The parent pointer's tag is a GMAC over [`Node::mac_input`]: the label, the
//! lineage uuid, level, index, birth and the children's logical encodings, never their
//! addresses, lengths or checksums, so the cleaner rewrites a node with its tag
//! unchanged. A node is born no earlier than any child (copy-on-write): the decoder
//! refuses a child born after its node. Three trees use this node: volume maps (leaves
//! point at data), the directory (leaves point at objects) and the segment table
//! (leaves hold segment entries: `segment::SegmentLeaf`). The directory and the
//! segment table share lineage 0, the pool epoch keys and the pool id as uuid, so the
//! segment table's MAC label differs (`"bulwark2 segs"`): neither tree's nodes pass
//! for the other's.

use crate::constants::{MAP_FANOUT, NODE_LEVELS_MAX, RECORD_HEADER_BYTES};
use crate::Result;

use super::address::SegmentShift;
use super::blkptr::{Blkptr, BLKPTR_BYTES};
use super::header::RecordType;
use super::{put, Fields};

pub const NODE_MAGIC: &[u8; 4] = b"BWN2";
pub const NODE_HEADER_BYTES: usize = 32;
pub const NODE_RAW_BYTES: usize = NODE_HEADER_BYTES + MAP_FANOUT * BLKPTR_BYTES;
/// A node record's stored bytes at most: its header and lz4's bound on the raw node,
/// so reading a node never allocates more than this.
pub const NODE_STORED_BYTES_MAX: usize =
    RECORD_HEADER_BYTES + lz4_flex::block::get_maximum_output_size(NODE_RAW_BYTES);

/// Where a node belongs, as its parent says: the decoder refuses a node whose header
/// says otherwise (a misdirected or replayed write).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeId {
    pub level: u8,
    pub index: u64,
    pub lineage: u32,
    pub birth: u64,
}

impl NodeId {
    /// Writes the 32-byte node header (magic included) at the start of `out`.
    pub(crate) fn encode_header(&self, out: &mut [u8]) {
        assert!(self.level < NODE_LEVELS_MAX, "node level {}", self.level);
        put(out, 0, NODE_MAGIC);
        out[4] = self.level;
        put(out, 8, &self.index.to_le_bytes());
        put(out, 16, &self.lineage.to_le_bytes());
        put(out, 24, &self.birth.to_le_bytes());
    }

    /// Checks the node header in `f` against `self` (what the parent says).
    pub(crate) fn check_header(&self, f: &Fields) -> Result<()> {
        f.check(f.array::<4>(0) == *NODE_MAGIC, || "bad magic".into())?;
        f.zero(5, 3, "bytes 5..8")?;
        f.zero(20, 4, "bytes 20..24")?;
        let got = NodeId {
            level: f.u8(4),
            index: f.u64(8),
            lineage: f.u32(16),
            birth: f.u64(24),
        };
        f.check(got == *self, || {
            format!("node is {got:?} but its parent expects {self:?}")
        })
    }
}

/// Which tree a node belongs to: what its leaves hold and its MAC label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tree {
    /// A dataset's map (lineage ≥ 1): leaves point at data records.
    Volume,
    /// The directory (lineage 0): leaves point at objects.
    Directory,
    /// The segment table (lineage 0): leaves are `SegmentLeaf`s.
    SegmentTable,
}

impl Tree {
    pub fn mac_label(self) -> &'static [u8] {
        match self {
            Tree::Volume | Tree::Directory => b"bulwark2 node",
            Tree::SegmentTable => b"bulwark2 segs",
        }
    }

    /// The type of a leaf's children, `None` where leaves hold no pointers.
    fn leaf_child(self) -> Option<RecordType> {
        match self {
            Tree::Volume => Some(RecordType::Data),
            Tree::Directory => Some(RecordType::Object),
            Tree::SegmentTable => None,
        }
    }
}

/// The bytes a node's GMAC covers: `label ‖ uuid ‖ level ‖ index ‖ birth ‖ slots`
/// (each slot's logical encoding). Shared with the segment table's leaves.
pub(crate) fn mac_input<'a>(
    tree: Tree,
    uuid: &[u8; 16],
    id: &NodeId,
    slots: impl Iterator<Item = &'a [u8]>,
) -> Vec<u8> {
    let mut m = Vec::with_capacity(40 + MAP_FANOUT * 64);
    m.extend_from_slice(tree.mac_label());
    m.extend_from_slice(uuid);
    m.push(id.level);
    m.extend_from_slice(&id.index.to_le_bytes());
    m.extend_from_slice(&id.birth.to_le_bytes());
    for s in slots {
        m.extend_from_slice(s);
    }
    m
}

/// Refuses a pointer to a map node that no commit writes: another type, or longer
/// than a node's largest encoding.
pub fn check_node_ptr(p: &Blkptr) -> std::result::Result<(), String> {
    if p.kind != RecordType::Node || p.len as usize > NODE_STORED_BYTES_MAX {
        return Err(format!(
            "points at a {:?} of {} bytes where a map node (at most {NODE_STORED_BYTES_MAX}) \
             belongs",
            p.kind, p.len
        ));
    }
    Ok(())
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    pub id: NodeId,
    pub ptrs: [Blkptr; MAP_FANOUT],
}

impl Node {
    pub fn empty(id: NodeId) -> Node {
        Node {
            id,
            ptrs: [Blkptr::HOLE; MAP_FANOUT],
        }
    }

    /// The raw node (before lz4). Panics on children `decode` would refuse.
    pub fn encode(&self, tree: Tree) -> Vec<u8> {
        if let Err(why) = self.check_children(tree) {
            panic!("encoding a map node whose {why}");
        }
        let mut out = vec![0u8; NODE_RAW_BYTES];
        self.id.encode_header(&mut out);
        for (i, p) in self.ptrs.iter().enumerate() {
            put(&mut out, NODE_HEADER_BYTES + i * BLKPTR_BYTES, &p.encode());
        }
        out
    }

    /// A raw node read from disk; `id` is what the parent pointer says (its birth
    /// included), `tree` which tree it is part of.
    pub fn decode(b: &[u8], id: &NodeId, tree: Tree, shift: SegmentShift) -> Result<Node> {
        let f = Fields::exact(b, NODE_RAW_BYTES, "map node")?;
        id.check_header(&f)?;
        let mut n = Node::empty(*id);
        for (i, p) in n.ptrs.iter_mut().enumerate() {
            let at = NODE_HEADER_BYTES + i * BLKPTR_BYTES;
            *p = Blkptr::decode(&b[at..at + BLKPTR_BYTES], shift)
                .map_err(|e| e.within(format!("map node {id:?} slot {i}")))?;
        }
        n.check_children(tree).map_err(|why| f.err(why))?;
        Ok(n)
    }

    fn check_children(&self, tree: Tree) -> std::result::Result<(), String> {
        let id = &self.id;
        if id.level == 0 && tree.leaf_child().is_none() {
            return Err(format!("leaf {id:?} of the {tree:?} is no pointer node"));
        }
        for (i, p) in self.ptrs.iter().enumerate().filter(|(_, p)| !p.is_hole()) {
            if id.level > 0 {
                check_node_ptr(p).map_err(|why| format!("slot {i} {why}"))?;
            } else if Some(p.kind) != tree.leaf_child() {
                return Err(format!(
                    "slot {i} points at a {:?} in a {tree:?} leaf",
                    p.kind
                ));
            }
            if p.birth > id.birth {
                return Err(format!(
                    "slot {i} is born at {}, after its node ({})",
                    p.birth, id.birth
                ));
            }
        }
        Ok(())
    }

    /// What the parent pointer's GMAC covers, `uuid` being the lineage's (the pool
    /// id for the directory).
    pub fn mac_input(&self, tree: Tree, uuid: &[u8; 16]) -> Vec<u8> {
        let logical: Vec<_> = self.ptrs.iter().map(Blkptr::logical_bytes).collect();
        mac_input(tree, uuid, &self.id, logical.iter().map(|l| &l[..]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::address::PoolAddr;
    use crate::format::blkptr::tests::{samples as ptr_samples, shift};
    use crate::format::blkptr::{FLAG_LZ4, FLAG_SEALED};
    use crate::format::testing::{fuzz_canonical, refused, with};

    fn id(level: u8, index: u64) -> NodeId {
        NodeId {
            level,
            index,
            lineage: 3,
            birth: 50,
        }
    }

    fn leaf() -> Node {
        let mut n = Node::empty(id(0, 9));
        let [sealed, plain, ..] = ptr_samples()[..] else {
            unreachable!()
        };
        for i in (0..MAP_FANOUT).filter(|i| i % 3 != 0) {
            n.ptrs[i] = if i % 2 == 0 { sealed } else { plain };
            n.ptrs[i].nonce = i as u32;
        }
        n
    }

    fn inner() -> Node {
        let mut n = Node::empty(id(2, 0));
        for i in (0..MAP_FANOUT).step_by(7) {
            n.ptrs[i] = Blkptr {
                addr: [
                    PoolAddr::new(i as u64, 0),
                    PoolAddr::new(i as u64 + 100, 32),
                ],
                len: 900 + i as u32,
                kind: RecordType::Node,
                flags: FLAG_LZ4,
                birth: 10 + i as u64 / 2,
                epoch: 1,
                nonce: i as u32,
                checksum: i as u64,
                tag: [i as u8; 16],
            };
        }
        n
    }

    #[test]
    fn golden_bytes() {
        let mut n = Node::empty(NodeId {
            level: 1,
            index: 0x0201,
            lineage: 0x0403,
            birth: 0x0605,
        });
        n.ptrs[63] = ptr_samples()[2];
        let b = n.encode(Tree::Volume);
        #[rustfmt::skip]
        let head: [u8; 32] = [
            b'B', b'W', b'N', b'2', 1, 0, 0, 0,
            0x01, 0x02, 0, 0, 0, 0, 0, 0,
            0x03, 0x04, 0, 0, 0, 0, 0, 0,
            0x05, 0x06, 0, 0, 0, 0, 0, 0,
        ];
        assert_eq!(b.len(), 4128);
        assert_eq!(b[..32], head);
        assert!(b[32..32 + 63 * 64].iter().all(|&x| x == 0));
        assert_eq!(b[4064..], ptr_samples()[2].encode());
        assert_eq!(Node::decode(&b, &n.id, Tree::Volume, shift()).unwrap(), n);
    }

    #[test]
    fn mac_input_is_label_uuid_place_and_logical_encodings() {
        let n = leaf();
        let uuid = [0x77; 16];
        let m = n.mac_input(Tree::Volume, &uuid);
        assert_eq!(m.len(), 13 + 16 + 1 + 8 + 8 + 64 * 36);
        assert_eq!(&m[..13], b"bulwark2 node");
        assert_eq!(&m[13..29], &uuid);
        assert_eq!(m[29], 0);
        assert_eq!(&m[30..38], &9u64.to_le_bytes());
        assert_eq!(&m[38..46], &50u64.to_le_bytes());
        assert_eq!(&m[46 + 36..46 + 72], &n.ptrs[1].logical_bytes());
        // Moving a child (physical fields) keeps the MAC input; its birth does not.
        let mut moved = n.clone();
        moved.ptrs[1].addr = [PoolAddr::new(400, 0), PoolAddr::NONE];
        moved.ptrs[1].checksum ^= 1;
        assert_eq!(moved.mac_input(Tree::Volume, &uuid), m);
        moved.ptrs[1].birth -= 1;
        assert_ne!(moved.mac_input(Tree::Volume, &uuid), m);
        let segs = inner().mac_input(Tree::SegmentTable, &uuid);
        assert_eq!(&segs[..13], b"bulwark2 segs");
        assert_ne!(segs, inner().mac_input(Tree::Directory, &uuid));
    }

    #[test]
    fn round_trip_and_refusals() {
        let s = shift();
        for (n, tree) in [(leaf(), Tree::Volume), (inner(), Tree::Directory)] {
            assert_eq!(Node::decode(&n.encode(tree), &n.id, tree, s).unwrap(), n);
        }
        let b = leaf().encode(Tree::Volume);
        let want = leaf().id;
        refused(
            Node::decode(&b[..4127], &want, Tree::Volume, s),
            "4127 bytes",
        );
        refused(
            Node::decode(&with(&b, 0, b"BWMN"), &want, Tree::Volume, s),
            "bad magic",
        );
        refused(
            Node::decode(&with(&b, 6, &[1]), &want, Tree::Volume, s),
            "bytes 5..8",
        );
        refused(
            Node::decode(&with(&b, 21, &[1]), &want, Tree::Volume, s),
            "bytes 20..24",
        );
        for other in [
            NodeId { level: 1, ..want },
            NodeId { index: 8, ..want },
            NodeId { lineage: 4, ..want },
            NodeId { birth: 51, ..want },
        ] {
            refused(Node::decode(&b, &other, Tree::Volume, s), "parent expects");
        }
        // A directory leaf holds objects, not data; a segment-table leaf no pointers.
        refused(
            Node::decode(&b, &want, Tree::Directory, s),
            "Data in a Directory leaf",
        );
        refused(
            Node::decode(&b, &want, Tree::SegmentTable, s),
            "no pointer node",
        );
        // A child born after its node.
        let late = 32 + 64 + 24;
        refused(
            Node::decode(&with(&b, late, &[51]), &want, Tree::Volume, s),
            "after its node",
        );
        // An inner node's child is a map node, short enough.
        let i = inner();
        let ib = i.encode(Tree::Volume);
        refused(
            Node::decode(&with(&ib, 32 + 20, &[1]), &i.id, Tree::Volume, s),
            "Data",
        );
        let long = (NODE_STORED_BYTES_MAX as u32 + 1).to_le_bytes();
        refused(
            Node::decode(&with(&ib, 32 + 16, &long), &i.id, Tree::Volume, s),
            "at most",
        );
        refused(
            Node::decode(&with(&ib, 32 + 21, &[FLAG_SEALED]), &i.id, Tree::Volume, s),
            "slot 0",
        );
    }

    #[test]
    fn decode_is_canonical_for_any_bytes() {
        let cases = [(leaf(), Tree::Volume), (inner(), Tree::Directory)];
        let valid: Vec<Vec<u8>> = cases.iter().map(|(n, t)| n.encode(*t)).collect();
        fuzz_canonical(
            "v2 Node::decode",
            &valid,
            3000,
            None,
            &|b| {
                let (n, tree) = if b.get(4) == Some(&0) {
                    &cases[0]
                } else {
                    &cases[1]
                };
                Node::decode(b, &n.id, *tree, shift()).map(|d| (d, *tree))
            },
            &|(n, tree)| n.encode(*tree),
        );
    }
}
