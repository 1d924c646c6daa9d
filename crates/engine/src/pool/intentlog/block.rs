//! The intent log: a FLUSH (or FUA) made durable with one small write and one device sync,
//! instead of a commit (decision 0010).
//!
//! Every change a client makes to a volume's map (a block written, trimmed or zeroed) is
//! noted, in order, beside the map (`VolumeState::intents`) once the block's record is
//! written. A flush takes the notes made since the last durable point, keeps the last one
//! per block, and appends them to the current generation's *chain*: 4 KiB blocks (two
//! copies on a `single` pool, one where the layout is redundant), each naming the slot
//! of the next, pre-allocated.
//! Then every device is synced once. With separate log devices (`devices`) the same blocks
//! go to a ring on them instead, with the records themselves after them when the flush is
//! small (then only the log devices are synced), else while the main devices are synced
//! for the records the entries name. The map itself is still written by the commit, on its
//! timer or its dirty-data bound; each commit starts a new chain, named by its superblock,
//! and the old chain's blocks are released once that superblock is written.
//!
//! Replay (import): from the superblock's chain head, each block that verifies (its own
//! blake3, `checksum::SELF_CHECKED`), belongs to this pool and generation and has the next
//! sequence number, and each entry whose record still verifies against its pointer, is
//! applied to the map as the write was; the first that does not ends the replay, with a
//! message. A block can only be durable with all the records its entries name durable when
//! the flush that wrote it finished (one sync covers both), and no later block exists
//! unless it did: so what replay stops at is a flush that never returned, and every
//! acknowledged flush is replayed whole. Nothing is applied twice: replay changes the
//! in-memory map only, and the import's commit starts a new chain.
//!
//! Space: a record a flush made durable must not be reused before the commit that follows
//! (replay may point at it): the flush ends the current recycle epoch, as a commit's
//! snapshot does (`Log::begin_snapshot`), so segments written so far are freed only by a
//! commit. Chain blocks are released after the commit that replaces their chain.
//!
//! Authentication (format 2, decision 0011): a block carries, before its unkeyed blake3
//! (which tells a good copy from a bad one), a MAC of everything before it, keyed by the
//! pool key (`Core::log_key`). Someone who writes the devices cannot append a block that
//! replay would apply: a block that fails its MAC ends the replay, as a torn one does.
//! Format 1 blocks (no MAC, 50 entries) are read only by `bulwark pool upgrade`.
//!
//! Bytes from disk: a block is at most one slot, its entry count is bounded by the slot,
//! every pointer is decoded and checked against the pool before anything reads it.

use crate::checksum::{seal_self_checked, SELF_CHECKED};
use crate::map::{Blkptr, ADDR_NONE, BLKPTR_BYTES};
use crate::{Error, Result};

/// One slot of the chain.
pub const LOG_BLOCK_BYTES: usize = 4096;
const MAGIC: &[u8; 8] = b"BWINTENT";
pub(crate) const HEADER_BYTES: usize = 64;
const ENTRY_BYTES: usize = 16 + BLKPTR_BYTES;
/// The MAC of bytes 0..MAC_AT (format 2), before the blake3 of bytes 0..4064.
const MAC_AT: usize = LOG_BLOCK_BYTES - 64;
/// Format 2: the chain id of the commit whose superblock starts this chain
/// (`Superblock::chain_id`), under the MAC: a block of another timeline that reused the
/// generation number (devices restored, the log device not) is not this chain's.
const CHAIN_AT: usize = MAC_AT - 16;
/// Entries one block holds: 49 (format 1's blocks, without the MAC, held 50).
pub const ENTRIES_PER_BLOCK: usize = (CHAIN_AT - HEADER_BYTES) / ENTRY_BYTES;
const ENTRIES_PER_BLOCK_V1: usize = (LOG_BLOCK_BYTES - HEADER_BYTES - 32) / ENTRY_BYTES;
/// Format 2, in the bytes after the last entry (zero in blocks written before them): the
/// slot of the block after next (main devices), so a lost block in a chain that goes on is
/// seen, and the sequence number of the first block of the flush that wrote this block
/// (every block after a block `k` whose `flush_first` is above `k` was written by a flush
/// that began after `k`'s had returned: proof that `k` was acknowledged).
const AFTER_AT: usize = HEADER_BYTES + ENTRIES_PER_BLOCK * ENTRY_BYTES;
const FLUSH_FIRST_AT: usize = AFTER_AT + 16;
const _: () = assert!(FLUSH_FIRST_AT + 8 <= CHAIN_AT);

/// The key of the log blocks' MACs (`keys::pool_key::PoolKey::log_key`).
pub type LogKey = crate::pool::format::superblock::SbKey;

fn mac(key: &LogKey, b: &[u8]) -> [u8; 32] {
    *blake3::keyed_hash(key, &b[..MAC_AT]).as_bytes()
}

/// One change to a volume's map: block `lba` of volume `volume` (its id) now points at
/// `ptr` (a hole: trimmed or zeroed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub volume: u64,
    pub lba: u64,
    pub ptr: Blkptr,
}

/// A chain block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    pub pool_id: [u8; 16],
    pub generation: u64,
    pub seq: u64,
    /// The slot of the next block (two copies).
    pub next: [u64; 2],
    /// On a log device (`devices`): how many slots after this block hold the stored bytes
    /// of its entries' records, one after another, each padded to 16 bytes (0: the
    /// records are on the main devices only). Always 0 on the main devices' chain.
    pub data_slots: u32,
    /// The chain id of the superblock that starts the chain (zeros in format 1).
    pub chain: [u8; 16],
    /// The slot of the block after `next` (main devices; `[ADDR_NONE; 2]` on a log
    /// device, whose later blocks follow in the ring): replay reads it when `next` holds
    /// nothing, to tell the chain's end from a block lost in a chain that goes on.
    pub after: [u64; 2],
    /// The sequence number of the first block of the flush that wrote this one.
    pub flush_first: u64,
    pub entries: Vec<Entry>,
}

impl Block {
    pub fn encode(&self, key: &LogKey) -> Vec<u8> {
        assert!(self.entries.len() <= ENTRIES_PER_BLOCK);
        let mut b = vec![0u8; LOG_BLOCK_BYTES];
        b[0..8].copy_from_slice(MAGIC);
        b[8..24].copy_from_slice(&self.pool_id);
        b[24..32].copy_from_slice(&self.generation.to_le_bytes());
        b[32..40].copy_from_slice(&self.seq.to_le_bytes());
        b[40..44].copy_from_slice(&(self.entries.len() as u32).to_le_bytes());
        b[44..48].copy_from_slice(&self.data_slots.to_le_bytes());
        b[48..56].copy_from_slice(&self.next[0].to_le_bytes());
        b[56..64].copy_from_slice(&self.next[1].to_le_bytes());
        for (i, e) in self.entries.iter().enumerate() {
            let at = HEADER_BYTES + i * ENTRY_BYTES;
            b[at..at + 8].copy_from_slice(&e.volume.to_le_bytes());
            b[at + 8..at + 16].copy_from_slice(&e.lba.to_le_bytes());
            e.ptr.encode(&mut b[at + 16..at + ENTRY_BYTES]);
        }
        b[AFTER_AT..AFTER_AT + 8].copy_from_slice(&self.after[0].to_le_bytes());
        b[AFTER_AT + 8..AFTER_AT + 16].copy_from_slice(&self.after[1].to_le_bytes());
        b[FLUSH_FIRST_AT..FLUSH_FIRST_AT + 8].copy_from_slice(&self.flush_first.to_le_bytes());
        b[CHAIN_AT..CHAIN_AT + 16].copy_from_slice(&self.chain);
        let m = mac(key, &b);
        b[MAC_AT..MAC_AT + 32].copy_from_slice(&m);
        seal_self_checked(&mut b);
        b
    }

    /// A block read back (already verified by its own checksum): `Ok(None)` when it is not
    /// the block `(pool_id, generation, seq)` of chain `chain` (stale bytes, or a block of
    /// another timeline: the end of the chain), `Corrupt` when it claims to be that block
    /// and its MAC under `key` fails. `key` `None`: a format 1 block (no MAC, no chain id),
    /// for `bulwark pool upgrade` only.
    pub fn decode(
        b: &[u8],
        key: Option<&LogKey>,
        pool_id: &[u8; 16],
        chain: &[u8; 16],
        generation: u64,
        seq: u64,
    ) -> Result<Option<Block>> {
        if b.len() != LOG_BLOCK_BYTES || &b[0..8] != MAGIC {
            return Ok(None);
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        // Leftovers (another pool's, another generation's, format 1 blocks in a ring after
        // an upgrade) end the chain quietly; only a block that claims to be the one
        // expected and fails its MAC is an alarm.
        if b[8..24] != pool_id[..] || u64_at(24) != generation || u64_at(32) != seq {
            return Ok(None);
        }
        let most = match key {
            Some(key) => {
                if mac(key, b)[..] != b[MAC_AT..MAC_AT + 32] {
                    return Err(Error::Corrupt(format!(
                        "intent log block {seq} fails authentication under the pool key"
                    )));
                }
                if b[CHAIN_AT..CHAIN_AT + 16] != chain[..] {
                    return Ok(None);
                }
                ENTRIES_PER_BLOCK
            }
            None => ENTRIES_PER_BLOCK_V1,
        };
        let count = u32::from_le_bytes(b[40..44].try_into().unwrap()) as usize;
        if count > most {
            return Err(Error::Corrupt(format!(
                "intent log block {seq} claims {count} entries, more than a block holds"
            )));
        }
        let next = [u64_at(48), u64_at(56)];
        let data_slots = u32::from_le_bytes(b[44..48].try_into().unwrap());
        let mut entries = Vec::with_capacity(count);
        for i in 0..count {
            let at = HEADER_BYTES + i * ENTRY_BYTES;
            let ptr = Blkptr::decode(&b[at + 16..at + ENTRY_BYTES])
                .map_err(|e| e.within(format!("intent log block {seq} entry {i}")))?;
            entries.push(Entry {
                volume: u64_at(at),
                lba: u64_at(at + 8),
                ptr,
            });
        }
        let (after, flush_first) = if key.is_some() {
            (
                [u64_at(AFTER_AT), u64_at(AFTER_AT + 8)],
                u64_at(FLUSH_FIRST_AT),
            )
        } else {
            ([ADDR_NONE; 2], 0)
        };
        Ok(Some(Block {
            pool_id: *pool_id,
            generation,
            seq,
            next,
            data_slots,
            chain: if key.is_some() { *chain } else { [0; 16] },
            after,
            flush_first,
            entries,
        }))
    }

    /// The sequence number a block's bytes claim (not verified: `decode` checks it).
    pub fn claimed_seq(b: &[u8]) -> Option<u64> {
        (b.len() == LOG_BLOCK_BYTES && &b[0..8] == MAGIC)
            .then(|| u64::from_le_bytes(b[32..40].try_into().unwrap()))
    }

    /// Whether this block proves that block `k` of its chain was acknowledged: it comes
    /// after `k` and was written by a flush that began after `k`'s had returned (flushes
    /// are one at a time, each synced before the next begins).
    pub fn proves_acknowledged(&self, k: u64) -> bool {
        self.seq > k && self.flush_first > k
    }
}

/// The pointer to a chain slot: for `read_verified` (the block checks itself) and for
/// releasing its space.
pub fn slot_ptr(slot: [u64; 2]) -> Blkptr {
    Blkptr {
        addr: slot,
        nonce: 0,
        len: LOG_BLOCK_BYTES as u32,
        flags: 0,
        key_gen: 0,
        checksum: SELF_CHECKED,
    }
}

/// The chain being appended to.
pub(crate) struct Chain {
    /// The generation whose superblock names this chain's head.
    pub generation: u64,
    /// Sequence number of the next block.
    pub seq: u64,
    /// Where the next block goes.
    pub next: [u64; 2],
    /// Where the block after it goes, once a block has named it (`Block::after`).
    pub after: Option<[u64; 2]>,
    /// Every slot of the chain (the written blocks and the next one), released once a
    /// commit has replaced the chain.
    pub slots: Vec<Blkptr>,
}

/// Volume `volume`'s notes since the last durable point, the last per block, in the
/// order made.
pub(crate) fn dedup_notes(volume: u64, notes: Vec<(u64, Blkptr)>) -> Vec<Entry> {
    if notes.is_empty() {
        return Vec::new();
    }
    let mut last = std::collections::HashMap::with_capacity(notes.len());
    for (i, (lba, _)) in notes.iter().enumerate() {
        last.insert(*lba, i);
    }
    notes
        .iter()
        .enumerate()
        .filter(|(i, (lba, _))| last[lba] == *i)
        .map(|(_, (lba, ptr))| Entry {
            volume,
            lba: *lba,
            ptr: *ptr,
        })
        .collect()
}
