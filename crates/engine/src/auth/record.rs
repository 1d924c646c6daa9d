//! Data records and map-node records of format 2, sealed or authenticated under one
//! epoch key, and opened only once their tag verifies (decision 0008, "Records on the
//! devices").
//!
//! - **Data record** = record header ‖ body. The body is the block, lz4-compressed when
//!   that saves at least 1/8, then either sealed, `GCM(K, n96(nonce), AAD_data, body)`
//!   with the ciphertext in the body's place, or stored as is with the tag
//!   `GMAC(K, n96(nonce), AAD_data ‖ body)`. `AAD_data = "bulwark2 data" ‖ lineage
//!   uuid ‖ logical block ‖ flags ‖ block size`. The tag goes into the pointer.
//! - **Map node** = record header ‖ lz4(raw node); the pointer's tag is
//!   `GMAC(K, n96(nonce), Node::mac_input)`, which covers the children's logical
//!   encodings and not their addresses, lengths or checksums.
//!
//! Nothing here trusts the record header: it must repeat what the tree says (type,
//! lineage, block or level and index), and it is covered only by the unkeyed checksum.
//! The checksum is not checked here: the tag authenticates the record (decision 0006),
//! the checksum is for the keyless paths (scrub, resilver, the cleaner).
//! Which key and which lineage a pointer may use is `keyring::Authenticator`'s to say;
//! these functions take the key already chosen.

use zeroize::Zeroizing;

use crate::checksum::xxh3_64;
use crate::codec::{AeadBackend, BlockCipher, CompressGuess};
use crate::constants::{AEAD_TAG_BYTES, BLOCK_BYTES_MAX, MAP_FANOUT, RECORD_HEADER_BYTES};
use crate::format::address::{PoolAddr, SegmentShift};
use crate::format::blkptr::{Blkptr, FLAG_LZ4, FLAG_SEALED};
use crate::format::header::{RecordHeader, RecordType};
use crate::format::node::{check_node_ptr, Node, NodeId, Tree, NODE_RAW_BYTES};
use crate::{Error, Result};

use super::n96;

/// The label that opens `AAD_data`.
pub const DATA_LABEL: &[u8; 13] = b"bulwark2 data";
/// Bytes of `AAD_data`: label, lineage uuid, logical block, flags, block size.
pub const DATA_AAD_BYTES: usize = 13 + 16 + 8 + 1 + 4;

/// The key of one epoch, with its AES-GCM key schedule built once.
pub struct EpochCipher {
    /// The epoch's number (what pointers name).
    pub no: u32,
    cipher: BlockCipher,
}

impl EpochCipher {
    pub fn new(no: u32, key: &Zeroizing<[u8; 32]>) -> EpochCipher {
        EpochCipher {
            no,
            cipher: BlockCipher::new(key),
        }
    }

    /// `new` on a given AES-GCM library (both give the same bytes).
    pub fn with_backend(no: u32, key: &Zeroizing<[u8; 32]>, backend: AeadBackend) -> EpochCipher {
        EpochCipher {
            no,
            cipher: BlockCipher::with_backend(key, backend),
        }
    }

    /// The GMAC of `input` under nonce `nonce`: AES-GCM of an empty plaintext.
    pub fn gmac(&self, nonce: u32, input: &[u8]) -> Result<[u8; 16]> {
        let mut tag = [0u8; AEAD_TAG_BYTES];
        self.cipher
            .seal96(n96(nonce), input, None, &mut [], &mut tag)?;
        Ok(tag)
    }

    /// Whether `tag` is the GMAC of `input` (compared by the AEAD's own open, in
    /// constant time).
    pub fn gmac_verifies(&self, nonce: u32, input: &[u8], tag: &[u8; 16]) -> bool {
        self.cipher
            .open_in_place96(n96(nonce), input, &mut [], tag)
            .is_ok()
    }
}

/// Where a data record belongs: checked against its header, bound by its AAD.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataPlace {
    /// The lineage whose epoch wrote the record (its id in the header, its uuid in
    /// the AAD).
    pub lineage: u32,
    pub uuid: [u8; 16],
    /// The logical block.
    pub block: u64,
    /// The dataset's block size: the length of the block before compression.
    pub block_bytes: u32,
}

/// `AAD_data` of a data record with pointer flags `flags`.
pub fn data_aad(place: &DataPlace, flags: u8) -> [u8; DATA_AAD_BYTES] {
    let mut a = [0u8; DATA_AAD_BYTES];
    a[..13].copy_from_slice(DATA_LABEL);
    a[13..29].copy_from_slice(&place.uuid);
    a[29..37].copy_from_slice(&place.block.to_le_bytes());
    a[37] = flags;
    a[38..].copy_from_slice(&place.block_bytes.to_le_bytes());
    a
}

/// What writing a record fixes in its pointer: all but the addresses, and the birth of
/// data (fixed when the pointer is installed, under the map lock; 0 here). A node's
/// birth is in its MAC, so it is fixed when the node is sealed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sealed {
    pub kind: RecordType,
    pub len: u32,
    pub flags: u8,
    pub birth: u64,
    pub epoch: u32,
    pub nonce: u32,
    pub checksum: u64,
    pub tag: [u8; 16],
}

impl Sealed {
    /// The pointer to the record written at `addr`, installed at `birth` (a node's
    /// must be the one it was sealed with).
    pub fn pointer(&self, addr: [PoolAddr; 2], birth: u64) -> Blkptr {
        assert!(
            self.birth == 0 || self.birth == birth,
            "a node sealed at birth {} installed at {birth}",
            self.birth
        );
        Blkptr {
            addr,
            len: self.len,
            kind: self.kind,
            flags: self.flags,
            birth,
            epoch: self.epoch,
            nonce: self.nonce,
            checksum: self.checksum,
            tag: self.tag,
        }
    }
}

fn auth_failed(what: impl std::fmt::Display) -> Error {
    Error::Corrupt(format!("{what} failed authentication (tag mismatch)"))
}

/// Appends the data record of `plain` (one block of `place.block_bytes`) to `out`:
/// sealed when `seal`, else authenticated only; lz4 first when `compress` is given and
/// it saves at least an eighth.
pub fn seal_data(
    key: &EpochCipher,
    nonce: u32,
    place: &DataPlace,
    seal: bool,
    compress: Option<&CompressGuess>,
    plain: &[u8],
    out: &mut Vec<u8>,
) -> Result<Sealed> {
    assert_eq!(plain.len(), place.block_bytes as usize, "one whole block");
    let at = out.len();
    let header = RecordHeader::Data {
        lineage: place.lineage,
        block: place.block,
    };
    out.extend_from_slice(&header.encode());
    let body_at = at + RECORD_HEADER_BYTES;
    let mut flags = 0;
    if compress.is_some_and(|g| g.try_block(plain)) {
        out.resize(
            body_at + lz4_flex::block::get_maximum_output_size(plain.len()),
            0,
        );
        let n = lz4_flex::block::compress_into(plain, &mut out[body_at..])
            .map_err(|e| Error::Invalid(format!("lz4: {e}")))?;
        if n <= plain.len() - plain.len() / 8 {
            out.truncate(body_at + n);
            flags |= FLAG_LZ4;
        }
    }
    if flags & FLAG_LZ4 == 0 {
        out.truncate(body_at);
        out.extend_from_slice(plain);
    }
    let mut tag = [0u8; AEAD_TAG_BYTES];
    if seal {
        flags |= FLAG_SEALED;
        let aad = data_aad(place, flags);
        key.cipher
            .seal96(n96(nonce), &aad, None, &mut out[body_at..], &mut tag)?;
    } else {
        let mut input = Vec::with_capacity(DATA_AAD_BYTES + out.len() - body_at);
        input.extend_from_slice(&data_aad(place, flags));
        input.extend_from_slice(&out[body_at..]);
        tag = key.gmac(nonce, &input)?;
    }
    Ok(Sealed {
        kind: RecordType::Data,
        len: (out.len() - at) as u32,
        flags,
        birth: 0,
        epoch: key.no,
        nonce,
        checksum: xxh3_64(&out[at..]),
        tag,
    })
}

/// The stored bytes are as long as the pointer says and begin with the header of the
/// place the tree read them for (a record moved to another block, lineage or node fails).
fn check_stored(stored: &[u8], ptr: &Blkptr, want: RecordHeader) -> Result<()> {
    if stored.len() != ptr.len as usize {
        return Err(Error::Corrupt(format!(
            "{} bytes read where the pointer says {}",
            stored.len(),
            ptr.len
        )));
    }
    let header = RecordHeader::decode(stored)?;
    if header != want {
        return Err(Error::Corrupt(format!(
            "header says {header:?}, the tree {want:?}"
        )));
    }
    Ok(())
}

/// Opens the data record `stored` that `ptr` points at into `out` (one block of
/// `place.block_bytes`), once its tag verifies. `out` holds nothing of the record when
/// this fails. Whether the pointer's sealed flag fits the lineage is the caller's
/// (`Authenticator`) to check before; this checks the rest.
pub fn open_data(
    key: &EpochCipher,
    ptr: &Blkptr,
    place: &DataPlace,
    stored: &[u8],
    out: &mut [u8],
) -> Result<()> {
    let r = open_data_unchecked(key, ptr, place, stored, out);
    if r.is_err() {
        out.fill(0);
    }
    r.map_err(|e| e.within(format_args!("data record of block {}", place.block)))
}

fn open_data_unchecked(
    key: &EpochCipher,
    ptr: &Blkptr,
    place: &DataPlace,
    stored: &[u8],
    out: &mut [u8],
) -> Result<()> {
    let corrupt = |m: String| Err(Error::Corrupt(m));
    if ptr.kind != RecordType::Data || ptr.epoch != key.no {
        return corrupt(format!(
            "pointer to a {:?} under epoch {} read as data under epoch {}",
            ptr.kind, ptr.epoch, key.no
        ));
    }
    if out.len() != place.block_bytes as usize || place.block_bytes > BLOCK_BYTES_MAX {
        return Err(Error::Invalid(format!(
            "a block of {} bytes read into {}",
            place.block_bytes,
            out.len()
        )));
    }
    check_stored(
        stored,
        ptr,
        RecordHeader::Data {
            lineage: place.lineage,
            block: place.block,
        },
    )?;
    let body = &stored[RECORD_HEADER_BYTES..];
    let aad = data_aad(place, ptr.flags);
    let lz4 = ptr.flags & FLAG_LZ4 != 0;
    if ptr.sealed() {
        if lz4 {
            let mut plain = body.to_vec();
            key.cipher
                .open_in_place96(n96(ptr.nonce), &aad, &mut plain, &ptr.tag)
                .map_err(|_| auth_failed("sealed data"))?;
            return decompress(&plain, out);
        }
        if body.len() != out.len() {
            return corrupt(format!(
                "sealed body of {} bytes for a block of {}",
                body.len(),
                out.len()
            ));
        }
        return key
            .cipher
            .open_into96(n96(ptr.nonce), &aad, body, &ptr.tag, out)
            .map_err(|_| auth_failed("sealed data"));
    }
    let mut input = Vec::with_capacity(DATA_AAD_BYTES + body.len());
    input.extend_from_slice(&aad);
    input.extend_from_slice(body);
    if !key.gmac_verifies(ptr.nonce, &input, &ptr.tag) {
        return Err(auth_failed("authenticated data"));
    }
    if lz4 {
        return decompress(body, out);
    }
    if body.len() != out.len() {
        return corrupt(format!(
            "body of {} bytes for a block of {}",
            body.len(),
            out.len()
        ));
    }
    out.copy_from_slice(body);
    Ok(())
}

/// lz4 of exactly `out.len()` bytes.
fn decompress(compressed: &[u8], out: &mut [u8]) -> Result<()> {
    let n = lz4_flex::block::decompress_into(compressed, out)
        .map_err(|e| Error::Corrupt(format!("lz4: {e}")))?;
    if n != out.len() {
        return Err(Error::Corrupt(format!(
            "lz4 body decompressed to {n} bytes, expected {}",
            out.len()
        )));
    }
    Ok(())
}

/// Appends the record of map node `node` of `tree` to `out` (header ‖ lz4(raw)) and
/// returns what its parent pointer holds; `uuid` is the lineage's (the pool id for the
/// directory and the segment table). The node's birth is the pointer's.
pub fn seal_node(
    key: &EpochCipher,
    nonce: u32,
    tree: Tree,
    uuid: &[u8; 16],
    node: &Node,
    out: &mut Vec<u8>,
) -> Result<Sealed> {
    let raw = node.encode(tree);
    let at = out.len();
    let header = RecordHeader::Node {
        level: node.id.level,
        lineage: node.id.lineage,
        index: node.id.index,
    };
    out.extend_from_slice(&header.encode());
    let body_at = out.len();
    out.resize(
        body_at + lz4_flex::block::get_maximum_output_size(raw.len()),
        0,
    );
    let n = lz4_flex::block::compress_into(&raw, &mut out[body_at..])
        .map_err(|e| Error::Invalid(format!("lz4: {e}")))?;
    out.truncate(body_at + n);
    let tag = key.gmac(nonce, &node.mac_input(tree, uuid))?;
    Ok(Sealed {
        kind: RecordType::Node,
        len: (out.len() - at) as u32,
        flags: FLAG_LZ4,
        birth: node.id.birth,
        epoch: key.no,
        nonce,
        checksum: xxh3_64(&out[at..]),
        tag,
    })
}

/// Where a map node belongs, as its parent says (its birth is the parent pointer's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodePlace {
    pub tree: Tree,
    pub level: u8,
    pub index: u64,
    /// The lineage whose epoch wrote the node: its id in the header, its uuid (the pool
    /// id for lineage 0) in the MAC.
    pub lineage: u32,
    pub uuid: [u8; 16],
}

/// Opens the map-node record `stored` that `ptr` points at: refuses a header, a node
/// header or children that are not what the parent says, then verifies the GMAC.
pub fn open_node(
    key: &EpochCipher,
    ptr: &Blkptr,
    place: &NodePlace,
    stored: &[u8],
    shift: SegmentShift,
) -> Result<Node> {
    open_node_unchecked(key, ptr, place, stored, shift).map_err(|e| {
        e.within(format_args!(
            "map node level {} index {} of the {:?}",
            place.level, place.index, place.tree
        ))
    })
}

fn open_node_unchecked(
    key: &EpochCipher,
    ptr: &Blkptr,
    place: &NodePlace,
    stored: &[u8],
    shift: SegmentShift,
) -> Result<Node> {
    check_node_ptr(ptr).map_err(Error::Corrupt)?;
    if ptr.flags != FLAG_LZ4 || ptr.epoch != key.no {
        return Err(Error::Corrupt(format!(
            "pointer with flags {:#04x} under epoch {} (a node is lz4 only, read under epoch {})",
            ptr.flags, ptr.epoch, key.no
        )));
    }
    check_stored(
        stored,
        ptr,
        RecordHeader::Node {
            level: place.level,
            lineage: place.lineage,
            index: place.index,
        },
    )?;
    let mut raw = vec![0u8; NODE_RAW_BYTES];
    decompress(&stored[RECORD_HEADER_BYTES..], &mut raw)?;
    let id = NodeId {
        level: place.level,
        index: place.index,
        lineage: place.lineage,
        birth: ptr.birth,
    };
    let node = Node::decode(&raw, &id, place.tree, shift)?;
    debug_assert_eq!(node.ptrs.len(), MAP_FANOUT);
    if !key.gmac_verifies(
        ptr.nonce,
        &node.mac_input(place.tree, &place.uuid),
        &ptr.tag,
    ) {
        return Err(auth_failed("map node"));
    }
    Ok(node)
}

/// Whether `stored` is what `ptr`'s unkeyed checksum says: how scrub, resilver and the
/// cleaner tell a good copy from a bad one without a key. Proves nothing against an
/// attacker, who can recompute it: only the tag does.
pub fn checksum_matches(ptr: &Blkptr, stored: &[u8]) -> bool {
    stored.len() == ptr.len as usize && xxh3_64(stored) == ptr.checksum
}
