//! The attacks of decision 0008 at library level: tampering, relocation, replay,
//! plaintext injection and a flipped sealed flag are refused; the keyless cleaner's
//! rewrite of physical fields is not. Golden vectors (computed apart, with Python's
//! `cryptography`, from 0008's text) pin the constructions; a fuzz loop pins that
//! nothing panics.

use zeroize::Zeroizing;

use super::record::{self, DataPlace};
use super::*;
use crate::codec::{AeadBackend, CompressGuess};
use crate::constants::RECORD_HEADER_BYTES;
use crate::format::address::{PoolAddr, SegmentShift};
use crate::format::blkptr::{Blkptr, BLKPTR_BYTES, FLAG_LZ4, FLAG_SEALED};
use crate::format::header::RecordType;
use crate::format::node::{Node, NodeId, Tree, NODE_RAW_BYTES};
use crate::hex::to_hex;
use crate::keys::epoch::{epoch_key, Epoch, EpochKind, EpochNumbers, EpochWriter};
use crate::Error;

const UUID: [u8; 16] = [0x22; 16];
const LINEAGE: u32 = 3;
const OTHER_UUID: [u8; 16] = [0x66; 16];
const OTHER_LINEAGE: u32 = 4;
const PAK: [u8; 32] = [0x33; 32];
const DK: [u8; 32] = [0x5a; 32];
const BLOCK_BYTES: u32 = 4096;

fn shift() -> SegmentShift {
    SegmentShift::new(20).unwrap()
}

/// One lineage: its writer and its reader, sharing the pool's epoch numbers.
struct World {
    uuid: [u8; 16],
    lineage: u32,
    sealer: Sealer,
    auth: Authenticator,
}

fn encrypted(uuid: [u8; 16], lineage: u32, dk: [u8; 32]) -> World {
    let writer = EpochWriter::new(lineage, uuid, 1, EpochKind::Sealed, Zeroizing::new(dk));
    let keyring = Keyring::encrypted(
        uuid,
        vec![KeyEntry {
            key_id: 1,
            source: uuid,
            kind: EpochKind::Sealed,
            data_key: Some(Zeroizing::new(dk)),
        }],
    )
    .unwrap();
    World {
        uuid,
        lineage,
        sealer: Sealer::new(writer),
        auth: Authenticator::new(keyring, Zeroizing::new(PAK)),
    }
}

fn unencrypted(uuid: [u8; 16], lineage: u32) -> World {
    let writer = EpochWriter::new(
        lineage,
        uuid,
        0,
        EpochKind::LineageAuth,
        Zeroizing::new(PAK),
    );
    World {
        uuid,
        lineage,
        sealer: Sealer::new(writer),
        auth: Authenticator::new(Keyring::unencrypted(uuid, &[]), Zeroizing::new(PAK)),
    }
}

fn text(seed: u8) -> Vec<u8> {
    format!("block {seed} of bulwark; ")
        .bytes()
        .cycle()
        .take(BLOCK_BYTES as usize)
        .collect()
}

fn noise(seed: u64) -> Vec<u8> {
    let mut rng = crate::fuzz::Rng::new(seed);
    rng.bytes(BLOCK_BYTES as usize)
}

impl World {
    /// Writes `plain` at `block`, installed at `birth`; the epoch enters the table.
    fn write(
        &mut self,
        numbers: &EpochNumbers,
        block: u64,
        plain: &[u8],
        lz4: bool,
        birth: u64,
    ) -> (Blkptr, Vec<u8>) {
        let guess = CompressGuess::default();
        let mut out = Vec::new();
        let (s, e) = self
            .sealer
            .seal_data(numbers, block, lz4.then_some(&guess), plain, &mut out)
            .unwrap();
        self.auth.learn_epoch(e, self.uuid).unwrap();
        let ptr = s.pointer([PoolAddr::new(7, 4096), PoolAddr::NONE], birth);
        (ptr, out)
    }

    fn read(&self, ptr: &Blkptr, block: u64, stored: &[u8]) -> crate::Result<Vec<u8>> {
        let mut out = vec![0xee; BLOCK_BYTES as usize];
        let r = self
            .auth
            .open_data(ptr, block, BLOCK_BYTES, stored, &mut out);
        if r.is_err() {
            assert!(out.iter().all(|&b| b == 0), "bytes left after a refusal");
        }
        r.map(|()| out)
    }

    /// Writes `node` of the volume map; returns its parent pointer and record.
    fn write_node(&mut self, numbers: &EpochNumbers, node: &Node) -> (Blkptr, Vec<u8>) {
        let mut out = Vec::new();
        let (s, e) = self
            .sealer
            .seal_node(numbers, Tree::Volume, node, &mut out)
            .unwrap();
        self.auth.learn_epoch(e, self.uuid).unwrap();
        let addr = [PoolAddr::new(8, 0), PoolAddr::new(9, 0)];
        (s.pointer(addr, node.id.birth), out)
    }

    fn read_node(&self, ptr: &Blkptr, level: u8, index: u64, stored: &[u8]) -> crate::Result<Node> {
        self.auth
            .open_node(ptr, Tree::Volume, level, index, stored, shift())
    }
}

#[track_caller]
fn refused<T: std::fmt::Debug>(r: crate::Result<T>, needle: &str) {
    match r {
        Err(Error::Corrupt(m)) => assert!(m.contains(needle), "{m:?} lacks {needle:?}"),
        other => panic!("expected Corrupt({needle:?}), got {other:?}"),
    }
}

/// The record bytes of `node` as any writer would store them (they depend on no key:
/// only the tag does), for forgeries.
fn node_record(node: &Node) -> Vec<u8> {
    let junk = EpochCipher::new(1, &Zeroizing::new([0; 32]));
    let mut out = Vec::new();
    record::seal_node(&junk, 0, Tree::Volume, &[0; 16], node, &mut out).unwrap();
    out
}

/// `ptr` moved to `stored`: new addresses, length and checksum, as the cleaner does.
fn moved(ptr: &Blkptr, stored: &[u8], segment: u64) -> Blkptr {
    Blkptr {
        addr: [PoolAddr::new(segment, 16), PoolAddr::NONE],
        len: stored.len() as u32,
        checksum: crate::checksum::xxh3_64(stored),
        ..*ptr
    }
}

fn leaf(birth: u64, ptrs: &[(usize, Blkptr)]) -> Node {
    let mut n = Node::empty(NodeId {
        level: 0,
        index: 0,
        lineage: LINEAGE,
        birth,
    });
    for &(i, p) in ptrs {
        n.ptrs[i] = p;
    }
    n
}

#[test]
fn records_round_trip_sealed_and_authenticated_with_and_without_lz4() {
    let numbers = EpochNumbers::new(1);
    for mut w in [encrypted(UUID, LINEAGE, DK), unencrypted(UUID, LINEAGE)] {
        for (plain, lz4) in [(text(1), true), (text(2), false), (noise(3), true)] {
            let (ptr, stored) = w.write(&numbers, 9, &plain, lz4, 5);
            let sealed = w.auth.keyring().encrypted;
            assert_eq!(ptr.sealed(), sealed);
            assert_eq!(ptr.flags & FLAG_LZ4 != 0, lz4 && plain[0] == b'b');
            assert_eq!(Blkptr::decode(&ptr.encode(), shift()).unwrap(), ptr);
            assert!(record::checksum_matches(&ptr, &stored));
            // Sealed records hide the block; authenticated ones store it as it is.
            let body = &stored[RECORD_HEADER_BYTES..];
            assert_eq!(body.windows(16).any(|x| x == &plain[..16]), !sealed);
            if !lz4 {
                assert_eq!(stored.len(), 16 + BLOCK_BYTES as usize, "4112 bytes, as v1");
            }
            assert_eq!(w.read(&ptr, 9, &stored).unwrap(), plain);
        }
    }
}

#[test]
fn every_tampered_byte_of_a_record_or_its_tag_is_refused() {
    let numbers = EpochNumbers::new(1);
    for mut w in [encrypted(UUID, LINEAGE, DK), unencrypted(UUID, LINEAGE)] {
        for lz4 in [false, true] {
            let (ptr, stored) = w.write(&numbers, 9, &text(4), lz4, 5);
            for i in 0..stored.len() {
                let mut t = stored.clone();
                t[i] ^= 1 << (i % 8);
                assert!(
                    matches!(w.read(&ptr, 9, &t), Err(Error::Corrupt(_))),
                    "byte {i} flipped"
                );
            }
            for bit in 0..128 {
                let mut p = ptr;
                p.tag[bit / 8] ^= 1 << (bit % 8);
                refused(w.read(&p, 9, &stored), "failed authentication");
            }
            refused(
                w.read(
                    &Blkptr {
                        nonce: ptr.nonce + 1,
                        ..ptr
                    },
                    9,
                    &stored,
                ),
                "tag",
            );
            refused(
                w.read(&Blkptr { epoch: 99, ..ptr }, 9, &stored),
                "epoch table",
            );
            refused(
                w.read(
                    &Blkptr {
                        flags: ptr.flags ^ FLAG_LZ4,
                        ..ptr
                    },
                    9,
                    &stored,
                ),
                "data record of block 9",
            );
        }
    }
}

#[test]
fn a_record_relocated_to_another_block_or_lineage_is_refused() {
    let numbers = EpochNumbers::new(1);
    let mut a = encrypted(UUID, LINEAGE, DK);
    let mut b = encrypted(OTHER_UUID, OTHER_LINEAGE, [0x77; 32]);
    let (ptr, stored) = a.write(&numbers, 9, &text(5), false, 5);
    // Another block of the same lineage: the header, and under it the AAD.
    refused(a.read(&ptr, 10, &stored), "header says");
    let mut rewritten = stored.clone();
    rewritten[8..16].copy_from_slice(&10u64.to_le_bytes());
    refused(a.read(&ptr, 10, &rewritten), "failed authentication");
    // Another lineage, even one that knows the epoch (the epoch table is the pool's).
    for e in a.auth_epochs() {
        b.auth.learn_epoch(e, UUID).unwrap();
    }
    refused(b.read(&ptr, 9, &stored), "keyring does not allow");
    // The AAD binds the lineage even under the right key.
    let key = EpochCipher::new(ptr.epoch, &a.epoch_key(ptr.epoch));
    let place = |uuid, block| DataPlace {
        lineage: LINEAGE,
        uuid,
        block,
        block_bytes: BLOCK_BYTES,
    };
    let mut out = vec![0; BLOCK_BYTES as usize];
    record::open_data(&key, &ptr, &place(UUID, 9), &stored, &mut out).unwrap();
    refused(
        record::open_data(&key, &ptr, &place(OTHER_UUID, 9), &stored, &mut out),
        "failed authentication",
    );
    // A clone that inherited the key reads the shared record, at its block only.
    let mut clone = encrypted(OTHER_UUID, OTHER_LINEAGE, [0x77; 32]);
    clone.auth = Authenticator::new(
        Keyring::encrypted(
            OTHER_UUID,
            vec![
                KeyEntry {
                    key_id: 1,
                    source: OTHER_UUID,
                    kind: EpochKind::Sealed,
                    data_key: Some(Zeroizing::new([0x77; 32])),
                },
                KeyEntry {
                    key_id: 1,
                    source: UUID,
                    kind: EpochKind::Sealed,
                    data_key: Some(Zeroizing::new(DK)),
                },
            ],
        )
        .unwrap(),
        Zeroizing::new(PAK),
    );
    for e in a.auth_epochs() {
        clone.auth.learn_epoch(e, UUID).unwrap();
    }
    assert_eq!(clone.read(&ptr, 9, &stored).unwrap(), text(5));
    refused(clone.read(&ptr, 10, &rewritten), "failed authentication");
}

impl World {
    fn auth_epochs(&self) -> Vec<Epoch> {
        self.sealer.epochs()
    }

    fn epoch_key(&self, no: u32) -> Zeroizing<[u8; 32]> {
        let e = self
            .sealer
            .epochs()
            .into_iter()
            .find(|e| e.no == no)
            .unwrap();
        epoch_key(&Zeroizing::new(DK), &e, &self.uuid)
    }
}

#[test]
fn an_older_version_of_a_block_or_a_node_does_not_pass_for_the_current_one() {
    let numbers = EpochNumbers::new(1);
    for mut w in [encrypted(UUID, LINEAGE, DK), unencrypted(UUID, LINEAGE)] {
        // X = A at generation 10, X = B at 11; each leaf under a root.
        let (pa, ra) = w.write(&numbers, 0, &text(6), true, 10);
        let (pb, rb) = w.write(&numbers, 0, &text(7), true, 11);
        let (l1, r1) = w.write_node(&numbers, &leaf(10, &[(0, pa)]));
        let (l2, r2) = w.write_node(&numbers, &leaf(11, &[(0, pb)]));
        let mut root = Node::empty(NodeId {
            level: 1,
            index: 0,
            lineage: w.lineage,
            birth: 11,
        });
        root.ptrs[0] = l2;
        let (rp, rr) = w.write_node(&numbers, &root);
        assert_eq!(w.read_node(&rp, 1, 0, &rr).unwrap(), root);
        assert_eq!(w.read_node(&l2, 0, 0, &r2).unwrap().ptrs[0], pb);
        assert_eq!(w.read(&pb, 0, &rb).unwrap(), text(7));
        // The old block's record under the current pointer.
        refused(w.read(&pb, 0, &ra), "failed authentication");
        refused(w.read(&moved(&pb, &ra, 3), 0, &ra), "failed authentication");
        // The old leaf's record in the current leaf's place: its birth says so...
        refused(
            w.read_node(&moved(&l2, &r1, 3), 0, 0, &r1),
            "parent expects",
        );
        // ...and with its birth rewritten, its MAC fails.
        let mut forged = w.read_node(&l1, 0, 0, &r1).unwrap();
        forged.id.birth = 11;
        let fr = node_record(&forged);
        refused(
            w.read_node(&moved(&l2, &fr, 3), 0, 0, &fr),
            "map node failed authentication",
        );
        // The old leaf's pointer, whole, put back into the root: the root's MAC fails.
        let mut old_root = root.clone();
        old_root.ptrs[0] = l1;
        let orr = node_record(&old_root);
        refused(
            w.read_node(&moved(&rp, &orr, 4), 1, 0, &orr),
            "map node failed authentication",
        );
        // A node read as another index or level.
        refused(w.read_node(&l2, 0, 1, &r2), "header says");
        refused(w.read_node(&rp, 2, 0, &rr), "header says");
    }
}

#[test]
fn plaintext_in_an_encrypted_lineage_is_refused_never_returned() {
    let numbers = EpochNumbers::new(1);
    let mut w = encrypted(UUID, LINEAGE, DK);
    let (ptr, stored) = w.write(&numbers, 9, &text(8), false, 5);
    // Someone with the pool key authenticates a plaintext record for this lineage,
    // under an auth-only epoch of its uuid that even enters the epoch table.
    let mut forger = unencrypted(UUID, LINEAGE);
    for lz4 in [false, true] {
        let (fp, fs) = forger.write(&numbers, 9, &text(9), lz4, 5);
        assert_eq!(forger.read(&fp, 9, &fs).unwrap(), text(9));
        for e in forger.sealer.epochs() {
            w.auth.learn_epoch(e, UUID).unwrap();
        }
        refused(
            w.read(&fp, 9, &fs),
            "an unencrypted record in an encrypted lineage",
        );
    }
    // The pointer of a sealed record with its sealed flag cleared (lz4-only or plain).
    for flags in [0, FLAG_LZ4] {
        refused(
            w.read(&Blkptr { flags, ..ptr }, 9, &stored),
            "says sealed = false",
        );
    }
    // And the other way: a sealed flag in an unencrypted lineage.
    let (fp, fs) = forger.write(&numbers, 9, &text(9), false, 5);
    refused(
        forger.read(
            &Blkptr {
                flags: FLAG_SEALED,
                ..fp
            },
            9,
            &fs,
        ),
        "says sealed = true",
    );
    // A keyring that would let an encrypted lineage read its own plaintext is refused.
    let own_plain = KeyEntry {
        key_id: 0,
        source: UUID,
        kind: EpochKind::LineageAuth,
        data_key: None,
    };
    refused(Keyring::encrypted(UUID, vec![own_plain]), "holds KeyEntry");
    refused(Keyring::encrypted(UUID, vec![]), "no data key of its own");
}

#[test]
fn a_flipped_sealed_flag_fails_the_leaf_mac() {
    let numbers = EpochNumbers::new(1);
    for mut w in [encrypted(UUID, LINEAGE, DK), unencrypted(UUID, LINEAGE)] {
        let (p, _) = w.write(&numbers, 0, &noise(10), false, 5);
        let (lp, lr) = w.write_node(&numbers, &leaf(6, &[(0, p)]));
        let mut forged = w.read_node(&lp, 0, 0, &lr).unwrap();
        forged.ptrs[0].flags ^= FLAG_SEALED;
        let fr = node_record(&forged);
        refused(
            w.read_node(&moved(&lp, &fr, 3), 0, 0, &fr),
            "map node failed authentication",
        );
    }
}

/// The keyless cleaner moves records: addresses, lengths and checksums change, in the
/// children of a node and in its parent pointer, and every tag still verifies.
#[test]
fn physical_fields_are_rewritten_without_a_key() {
    let numbers = EpochNumbers::new(1);
    for mut w in [encrypted(UUID, LINEAGE, DK), unencrypted(UUID, LINEAGE)] {
        let blocks: Vec<(Blkptr, Vec<u8>)> = (0..4)
            .map(|i| w.write(&numbers, i, &text(i as u8), i % 2 == 0, 5))
            .collect();
        let slots: Vec<(usize, Blkptr)> =
            blocks.iter().enumerate().map(|(i, b)| (i, b.0)).collect();
        let (lp, lr) = w.write_node(&numbers, &leaf(6, &slots));
        // The cleaner's rewrite, from the stored bytes alone.
        let mut n = Node::decode(
            &lz4_flex::block::decompress(&lr[RECORD_HEADER_BYTES..], NODE_RAW_BYTES).unwrap(),
            &NodeId {
                level: 0,
                index: 0,
                lineage: LINEAGE,
                birth: lp.birth,
            },
            Tree::Volume,
            shift(),
        )
        .unwrap();
        for (i, (p, stored)) in blocks.iter().enumerate() {
            let mut copy = moved(p, stored, 100 + i as u64);
            copy.addr[1] = PoolAddr::new(200 + i as u64, 32);
            n.ptrs[i] = copy;
        }
        n.ptrs[1].checksum ^= 0xdead; // a stale checksum is scrub's to find, not the MAC's
        let nr = node_record(&n);
        assert_ne!(nr, lr);
        let np = moved(&lp, &nr, 300);
        assert!(record::checksum_matches(&np, &nr));
        let got = w.read_node(&np, 0, 0, &nr).unwrap();
        assert_eq!(got, n);
        for (i, (_, stored)) in blocks.iter().enumerate() {
            assert_eq!(
                w.read(&got.ptrs[i], i as u64, stored).unwrap(),
                text(i as u8)
            );
        }
    }
}

#[test]
fn records_across_epoch_rollover_all_verify() {
    let numbers = EpochNumbers::new(1);
    let writer =
        EpochWriter::with_limit(LINEAGE, UUID, 1, EpochKind::Sealed, Zeroizing::new(DK), 2);
    let mut w = encrypted(UUID, LINEAGE, DK);
    w.sealer = Sealer::new(writer);
    let written: Vec<_> = (0..5)
        .map(|i| w.write(&numbers, i, &text(i as u8), false, 5))
        .collect();
    let pairs: Vec<(u32, u32)> = written.iter().map(|(p, _)| (p.epoch, p.nonce)).collect();
    assert_eq!(pairs, [(1, 0), (1, 1), (2, 0), (2, 1), (3, 0)]);
    for (i, (p, s)) in written.iter().enumerate() {
        assert_eq!(w.read(p, i as u64, s).unwrap(), text(i as u8));
    }
}

/// The constructions of 0008 pinned by vectors computed apart (Python `cryptography`:
/// HKDF-SHA256, AESGCM) from the ADR's text: epoch key, `n96`, `AAD_data`, the record
/// header, the tag out of the record; the node MAC input byte by byte.
#[test]
fn golden_sealed_record_authenticated_record_and_node_mac() {
    let salt: [u8; 16] = std::array::from_fn(|i| 0xa0 + i as u8);
    let sealed_epoch = Epoch {
        no: 5,
        lineage: LINEAGE,
        key_id: 1,
        kind: EpochKind::Sealed,
        salt,
    };
    let dk = Zeroizing::new(std::array::from_fn(|i| i as u8));
    let k = epoch_key(&dk, &sealed_epoch, &UUID);
    assert_eq!(
        to_hex(&k[..]),
        "62d13499ee5963c259025adfa69703fdd83d861b66df1f0099068726c14802fc"
    );
    let key = EpochCipher::new(5, &k);
    let plain: Vec<u8> = (0..4096u32).map(|i| ((i * 31 + 7) % 251) as u8).collect();
    let place = DataPlace {
        lineage: LINEAGE,
        uuid: UUID,
        block: 0x0102_0304_0506_0708,
        block_bytes: 4096,
    };
    let mut out = Vec::new();
    let s = record::seal_data(&key, 9, &place, true, None, &plain, &mut out).unwrap();
    assert_eq!(
        (s.kind, s.flags, s.len, s.epoch, s.nonce),
        (RecordType::Data, FLAG_SEALED, 4112, 5, 9)
    );
    assert_eq!(to_hex(&out[..16]), "01000000030000000807060504030201");
    assert_eq!(to_hex(&out[16..32]), "142e1dcc6aceb206c26c36b3b1c3879f");
    assert_eq!(to_hex(&s.tag), "cc9613be7898983c9531b0986cd81008");
    let sha = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, &out);
    assert_eq!(
        to_hex(sha.as_ref()),
        "678ffb562de079f6c872eebeffe34f4ef9cbe6c3662d582c3e960d235c5eca32"
    );
    assert_eq!(s.checksum, crate::checksum::xxh3_64(&out));

    let auth_epoch = Epoch {
        no: 6,
        key_id: 0,
        kind: EpochKind::LineageAuth,
        ..sealed_epoch
    };
    let auth_key = EpochCipher::new(6, &epoch_key(&Zeroizing::new(PAK), &auth_epoch, &UUID));
    let mut out = Vec::new();
    let s = record::seal_data(&auth_key, 0, &place, false, None, &plain, &mut out).unwrap();
    assert_eq!((s.flags, s.len), (0, 4112));
    assert_eq!(&out[16..], &plain[..]);
    assert_eq!(to_hex(&s.tag), "b05f82256bd112cf8a0ee96c799aff8d");

    let child = |birth, nonce, tag| Blkptr {
        addr: [PoolAddr::new(1, 0), PoolAddr::new(2, 0)],
        len: 900,
        kind: RecordType::Node,
        flags: FLAG_LZ4,
        birth,
        epoch: 5,
        nonce,
        checksum: 0x1234,
        tag: [tag; 16],
    };
    let mut node = Node::empty(NodeId {
        level: 1,
        index: 2,
        lineage: LINEAGE,
        birth: 40,
    });
    node.ptrs[0] = child(30, 1, 0x44);
    node.ptrs[5] = child(40, 2, 0x55);
    assert_eq!(node.mac_input(Tree::Volume, &UUID).len(), 2350);
    for backend in [AeadBackend::AwsLc, AeadBackend::Ring] {
        let key = EpochCipher::with_backend(5, &k, backend);
        let mut out = Vec::new();
        let s = record::seal_node(&key, 11, Tree::Volume, &UUID, &node, &mut out).unwrap();
        assert_eq!((s.kind, s.flags, s.birth), (RecordType::Node, FLAG_LZ4, 40));
        assert_eq!(to_hex(&s.tag), "0b239cd0afed97e24d118cb75af758ec");
        let ptr = s.pointer([PoolAddr::new(1, 0), PoolAddr::NONE], 40);
        let place = record::NodePlace {
            tree: Tree::Volume,
            level: 1,
            index: 2,
            lineage: LINEAGE,
            uuid: UUID,
        };
        assert_eq!(
            record::open_node(&key, &ptr, &place, &out, shift()).unwrap(),
            node
        );
    }
}

fn logical(n: &Node) -> Vec<[u8; 36]> {
    n.ptrs.iter().map(Blkptr::logical_bytes).collect()
}

/// Opening gives the block or `Corrupt` for any pointer and record bytes, never panics,
/// and nothing but the written block ever comes out.
#[test]
fn open_never_panics_and_never_returns_a_forgery() {
    let numbers = EpochNumbers::new(1);
    let mut enc = encrypted(UUID, LINEAGE, DK);
    let mut plain = unencrypted(UUID, LINEAGE);
    let block = text(11);
    let mut valid = Vec::new();
    let mut leaves = Vec::new();
    let case = |p: &Blkptr, s: &[u8]| [&p.encode()[..], s].concat();
    for w in [&mut enc, &mut plain] {
        for lz4 in [false, true] {
            let (p, s) = w.write(&numbers, 0, &block, lz4, 5);
            valid.push(case(&p, &s));
        }
        let (p, _) = w.write(&numbers, 0, &block, false, 5);
        let l = leaf(6, &[(0, p), (63, p)]);
        let (lp, lr) = w.write_node(&numbers, &l);
        valid.push(case(&lp, &lr));
        leaves.push(logical(&l));
    }
    // Only physical fields may differ from what was written.
    let expected_leaf = |n: &Node| leaves.contains(&logical(n));
    crate::fuzz::never_panics("auth::open", &valid, 20_000, None, &|b| {
        let Some((p, stored)) = b.split_at_checked(BLKPTR_BYTES) else {
            return;
        };
        let Ok(ptr) = Blkptr::decode(p, shift()) else {
            return;
        };
        for w in [&enc, &plain] {
            match ptr.kind {
                RecordType::Node => match w.read_node(&ptr, 0, 0, stored) {
                    Ok(n) => assert!(expected_leaf(&n), "a forged node passed: {n:?}"),
                    Err(Error::Corrupt(_)) => {}
                    Err(e) => panic!("not Corrupt: {e}"),
                },
                _ => match w.read(&ptr, 0, stored) {
                    Ok(got) => assert_eq!(got, block, "a forged block passed"),
                    Err(Error::Corrupt(_)) => {}
                    Err(e) => panic!("not Corrupt: {e}"),
                },
            }
        }
    });
}
