//! Every bound and fixed size in one place, with compile-time checks.

/// Default bound on the clean map-node cache.
pub const CACHE_BYTES_DEFAULT: u64 = 256 << 20;

/// Bytes reserved at the front and at the back of every device for superblock slots.
pub const DEVICE_RESERVED_FRONT: u64 = 1 << 20;
pub const DEVICE_RESERVED_BACK: u64 = 1 << 20;
/// One superblock slot.
pub const SUPERBLOCK_BYTES: usize = 4096;
/// Slot offsets inside the front and back regions (two slots each, written alternately).
pub const SUPERBLOCK_SLOT_OFFSETS: [u64; 2] = [0, 256 << 10];
/// Smallest device the pool accepts.
pub const DEVICE_BYTES_MIN: u64 = 16 << 20;
/// Most devices in one pool.
pub const DEVICES_MAX: usize = 16;

/// The log is cut into segments of this size; space is reclaimed a segment at a time.
pub const SEGMENT_BYTES: u64 = 1 << 20;
/// Segments below a device's last whole one that import looks through for the back copies
/// of its labels when no front slot is readable (a device grown since `pool create` keeps
/// them lower; each place costs two label reads, so a blank disk listed as a member costs
/// at most 512 small reads, a few seconds on a spinning disk).
pub const BACK_SEARCH_SEGMENTS: u64 = 256;
/// How long a commit, a recycle or the local cache waits for reads to finish before freeing
/// or giving back segments (`Store::drain_reads`): longer only when reads wait for the
/// object store, and then the freeing waits for a later commit instead.
pub const GATE_WAIT: std::time::Duration = std::time::Duration::from_millis(20);
/// Reads from the object store of one given-back segment after which the local cache
/// brings it back whole (`Core::bring_back`).
pub const REFILL_AFTER_READS: u32 = 8;
/// Given-back segments whose reads are counted at once (past it the counts start over).
pub const COLD_SEGMENTS_TRACKED: usize = 4096;
/// Segments waiting to be brought back at most (more wait for their reads to ask again).
pub const REFILL_WANTED_MAX: usize = 256;
/// Commits in a row that gave up waiting (`GATE_WAIT`) before one waits as long as it takes.
pub const GATE_WAIT_DEFERRALS_MAX: u64 = 16;
/// Records inside a segment start on this alignment.
pub const RECORD_ALIGN: u64 = 16;
/// Segments kept back from client data and the cleaner's moves so commits can always
/// proceed: the volume table's record (one segment per copy at most) and slack.
pub const SEGMENTS_RESERVED: u32 = 4;
/// The part of `SEGMENTS_RESERVED` nothing but a commit's volume table may take.
pub const TABLE_SEGMENTS: u32 = METADATA_COPIES as u32;
/// Segments kept from client data for the cleaner, on top of the commit's room: at least
/// this many, and a 64th of the pool (`Log::reserve`).
pub const CLEAN_RESERVE_MIN: u32 = 4;
/// A writer waiting for space gets ENOSPC after this many commits in a row freed nothing,
/// or after this long without a segment freed (`Store::wait_for`).
pub const SPACE_WAIT_FUTILE: u32 = 8;
pub const SPACE_WAIT_MAX: std::time::Duration = std::time::Duration::from_secs(30);
/// How long a writer waiting for space sleeps between its checks (woken sooner when a
/// round frees space; in stepped mode, the clock a round takes).
pub const SPACE_WAIT_TICK: std::time::Duration = std::time::Duration::from_millis(100);
/// The longest a writer waits for space in all, from its first try, however the free
/// space moves meanwhile (`Store::wait_until`).
pub const SPACE_WAIT_HARD: std::time::Duration = std::time::Duration::from_secs(90);
/// Cleaning passes made while writers waited that, together, gained no free segment:
/// cleaning is then declared stuck (`Core::maintenance_loop`), writers get ENOSPC at once.
pub const CLEAN_FUTILE_PASSES: u32 = 8;
/// How long a command that changes what a volume is (destroy, rollback, key unload or
/// erase) waits for a background batch over it (a scrub batch, a key rotation batch) to
/// end before it answers busy (`Core::quiesce_for_change`).
pub const QUIESCE_WAIT_MAX: std::time::Duration = std::time::Duration::from_secs(60);
/// Clean when fewer free segments than this remain (or `FREE_PERCENT_LOW` of the pool).
pub const SEGMENTS_FREE_LOW: u32 = 8;
/// With holes first (`OpenOptions::holes_first`): the cleaner runs when fewer free
/// segments than this remain above what client data may not take (or a writer waits).
pub const HOLES_FIRST_CLEAN_MARGIN: u32 = 4;
/// Seconds with no client read or write before the defragmenter starts (`pool/defrag.rs`).
pub const DEFRAG_IDLE_SECS: u64 = 5;
pub const FREE_PERCENT_LOW: u32 = 10;
/// At most this many segments are emptied in one cleaning pass.
pub const CLEAN_BATCH_SEGMENTS: usize = 128;

/// Block sizes a volume may use.
pub const BLOCK_BYTES_MIN: u32 = 4096;
pub const BLOCK_BYTES_MAX: u32 = 128 << 10;
pub const BLOCK_BYTES_DEFAULT: u32 = 4096;
/// Largest volume (2^60 bytes keeps every offset arithmetic inside u64).
pub const VOLUME_BYTES_MAX: u64 = 1 << 60;

/// Longest record a block pointer may describe: its footprint fits one segment, and a
/// parity stripe has fewer than `DEVICES_MAX` data shards. Bytes from disk: a longer
/// `len` is refused before any buffer is sized by it.
pub const RECORD_BYTES_MAX: u64 = SEGMENT_BYTES * DEVICES_MAX as u64;
/// Pool addresses are below this: segment numbers are u32.
pub const POOL_ADDRESS_END: u64 = (u32::MAX as u64 + 1) * SEGMENT_BYTES;
/// Largest decompressed metadata record whose length is not known before reading it
/// (the volume table: about 1 KiB per volume).
pub const META_RAW_BYTES_MAX: usize = 64 << 20;

/// Block-map radix tree: 64 pointers per node.
pub const MAP_FANOUT_SHIFT: u32 = 6;
pub const MAP_FANOUT: usize = 1 << MAP_FANOUT_SHIFT;
/// Commit early when this many map nodes are dirty, summed over the pool's volumes
/// (bounds memory between flushes: 64 MiB of 4 KiB nodes). Random writes dirty a whole
/// leaf each, so this sets how often they force a commit: at 16384, random 4 KiB
/// writes over a whole 2 GiB volume (8,322 nodes) wait for the timer.
pub const MAP_DIRTY_NODES_MAX: usize = 16384;
/// Copies of every metadata record (map nodes, volume table) inside the log, on top of the layout's copies.
pub const METADATA_COPIES: usize = 2;

/// Background commit interval: unflushed writes are durable after at most this long.
pub const COMMIT_INTERVAL_MS: u64 = 5000;
/// How often a serving daemon with an object store checks that it still holds the pool
/// (`pool::tier`), while clients use it; an idle pool is not checked.
pub const TIER_CHECK_INTERVAL: std::time::Duration = std::time::Duration::from_secs(30);
/// How often a serving daemon collects the objects no commit references (`Tier::collect`).
pub const TIER_COLLECT_INTERVAL: std::time::Duration = std::time::Duration::from_secs(600);
/// How old such an object must be before it is deleted, unless `serve` says otherwise.
pub const TIER_GC_GRACE: std::time::Duration = std::time::Duration::from_secs(3600);
/// Nonces are handed out from a range reserved in the superblock, this many at a time.
pub const NONCE_RESERVE_STEP: u64 = 1 << 24;
/// Commit early once this many segments have emptied (fewer on small pools: an eighth of
/// them), so a sustained overwrite reuses recently written, still-cached segments.
pub const RELEASE_COMMIT_SEGMENTS_MAX: u32 = 256;
/// Recyclable segments (emptied within the epoch they were opened in) freed together:
/// each batch waits out the reads in flight once.
pub const RECYCLE_BATCH_SEGMENTS: usize = 32;
/// Start device writeback after this many bytes written (bounds the work left for fsync).
/// 1 MiB: a client flushing every 2 MiB (64 KiB writes, a FLUSH every 32) then finds most
/// of them on their way to the disk already. Measured against 16 MiB (2026-11-26, A/B
/// alternated, preallocated `single` pool): 64K write QD32 fsync=32 17.6k → 20.4k IOPS
/// (mean of 4), random overwrite at 50% fill unchanged or better (64K, 4K).
pub const WRITEBACK_KICK_BYTES: u64 = 1 << 20;
/// Whole blocks of one request handled as a batch (one device I/O per run of records).
pub const BATCH_BYTES_MAX: usize = 1 << 20;
/// Stripe locks serialise read-modify-write of one block.
pub const STRIPE_LOCKS: usize = 1024;

/// AES-256-GCM tag length.
pub const AEAD_TAG_BYTES: usize = 16;

const _: () = assert!(SEGMENT_BYTES % RECORD_ALIGN == 0);
const _: () = assert!(TABLE_SEGMENTS < SEGMENTS_RESERVED);
const _: () = assert!(SEGMENT_BYTES >= 2 * (BLOCK_BYTES_MAX as u64 + AEAD_TAG_BYTES as u64));
const _: () = assert!(DEVICE_RESERVED_FRONT > SUPERBLOCK_SLOT_OFFSETS[1] + SUPERBLOCK_BYTES as u64);
const _: () = assert!(DEVICE_RESERVED_FRONT % SEGMENT_BYTES == 0);
const _: () = assert!(BLOCK_BYTES_DEFAULT.is_power_of_two());

/// Cache device (`cachedev`): its label at offset 0, then a ring of entries, each a header
/// and the record's stored bytes, padded to `CACHEDEV_ENTRY_ALIGN`.
pub const CACHEDEV_LABEL_BYTES: usize = 4096;
pub const CACHEDEV_HEADER_BYTES: usize = 128;
pub const CACHEDEV_ENTRY_ALIGN: u64 = 128;
/// Largest record the cache keeps (a 128 KiB block and its tag fit).
pub const CACHEDEV_RECORD_BYTES_MAX: usize = 256 << 10;
/// Fills waiting for the cache's writer thread, in bytes; more are dropped.
pub const CACHEDEV_FILL_QUEUE_BYTES: usize = 16 << 20;
/// Entries written with one device write, at most.
pub const CACHEDEV_FILL_BATCH_BYTES: usize = 1 << 20;
/// Bytes the scan at open reads at a time.
pub const CACHEDEV_SCAN_CHUNK_BYTES: usize = 4 << 20;
/// Largest log position a cache entry header may carry (2^62 bytes written: never
/// reached; a header past it is not an entry).
pub const CACHEDEV_LOG_POSITION_MAX: u64 = 1 << 62;
/// Smallest cache device: its label and a ring of a few batches.
pub const CACHEDEV_BYTES_MIN: u64 = 4 << 20;
/// Entries the cache device's in-memory index holds at most (about 80 bytes each: some
/// 640 MiB), at start and while it runs: a ring of more small records than that serves
/// the newest this many. A device's size is not a memory budget (nor is what its bytes
/// claim: a scan of garbage finds many entries).
pub const CACHEDEV_INDEX_ENTRIES_MAX: usize = 8 << 20;

const _: () = assert!(CACHEDEV_LABEL_BYTES as u64 % CACHEDEV_ENTRY_ALIGN == 0);
const _: () = assert!(CACHEDEV_HEADER_BYTES as u64 % CACHEDEV_ENTRY_ALIGN == 0);
const _: () =
    assert!(CACHEDEV_RECORD_BYTES_MAX as u64 >= BLOCK_BYTES_MAX as u64 + AEAD_TAG_BYTES as u64);
const _: () =
    assert!(CACHEDEV_HEADER_BYTES + CACHEDEV_RECORD_BYTES_MAX <= CACHEDEV_FILL_BATCH_BYTES);
const _: () = assert!(
    CACHEDEV_BYTES_MIN - CACHEDEV_LABEL_BYTES as u64 >= 2 * CACHEDEV_FILL_BATCH_BYTES as u64
);
