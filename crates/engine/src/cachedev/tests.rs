//! The cache device's index (placement, eviction, rebuild) and the device end to end.

use super::*;

fn sum_of(bytes: &[u8]) -> Checksum {
    checksum::checksum_sealed(bytes)
}

const RING: u64 = 4 << 20;

#[test]
fn index_evicts_first_in_first_out_and_skips_the_lap_tail() {
    let mut idx = Index::new(RING);
    let bytes = entry_bytes(4112); // a 4 KiB sealed block
    let per_lap = RING / bytes;
    let sum = sum_of(b"x");
    let mut placed = Vec::new();
    for i in 0..per_lap {
        let addr = i * 16;
        let lp = idx.place(bytes, addr);
        assert_eq!(lp, i * bytes, "entries lie end to end");
        idx.insert(addr, &sum, 4112, lp);
        placed.push((addr, lp));
    }
    assert_eq!(idx.entries() as u64, per_lap);
    // The next entry does not fit before the end: it goes to the ring's start (the next
    // lap) and evicts exactly the entries it overwrites, oldest first.
    let lp = idx.place(bytes, 1 << 40);
    assert_eq!(lp % RING, 0);
    assert_eq!(lp, RING);
    idx.insert(1 << 40, &sum, 4112, lp);
    assert!(
        idx.get(placed[0].0, &sum, 4112).is_none(),
        "the oldest entry was evicted"
    );
    assert!(
        idx.get(placed[1].0, &sum, 4112).is_some(),
        "the next one is still there"
    );
    assert!(idx.get(1 << 40, &sum, 4112).is_some());
    // A second lap evicts every entry of the first.
    for i in 0..per_lap {
        let addr = (1 << 41) + i * 16;
        let lp = idx.place(bytes, addr);
        idx.insert(addr, &sum, 4112, lp);
    }
    for (addr, _) in &placed {
        assert!(idx.get(*addr, &sum, 4112).is_none());
    }
    assert!(idx.used <= RING);
}

#[test]
fn index_tells_a_reused_address_apart_and_drops_only_the_entry_it_names() {
    let mut idx = Index::new(RING);
    let (old, new) = (sum_of(b"old"), sum_of(b"new"));
    let lp = idx.place(entry_bytes(100), 4096);
    idx.insert(4096, &old, 100, lp);
    assert!(idx.get(4096, &old, 100).is_some());
    assert!(
        idx.get(4096, &new, 100).is_none(),
        "another checksum at the address"
    );
    assert!(idx.get(4096, &old, 99).is_none(), "another length");
    // A newer entry for the address replaces the older; dropping the older's place
    // leaves the newer alone.
    let lp2 = idx.place(entry_bytes(100), 4096);
    idx.insert(4096, &new, 100, lp2);
    assert!(!idx.remove_if(4096, lp));
    assert!(idx.get(4096, &new, 100).is_some());
    assert!(idx.remove_if(4096, lp2));
    assert!(idx.get(4096, &new, 100).is_none());
}

#[test]
fn index_rebuild_keeps_the_newest_lap_only() {
    let bytes = entry_bytes(4112);
    let per_lap = RING / bytes;
    let mut found = Vec::new();
    // A lap and a half written: the first half-lap's entries were overwritten on the
    // device, but the scan could still find some (as gap leftovers) with old positions.
    for i in 0..(per_lap + per_lap / 2) {
        let lp = if i < per_lap {
            i * bytes
        } else {
            RING + (i - per_lap) * bytes
        };
        found.push((lp, bytes as u32, i * 16, 4112u32, 7u64));
    }
    found.reverse();
    let idx = Index::rebuild(RING, found);
    let head = RING + (per_lap / 2) * bytes;
    assert_eq!(idx.head, head);
    for i in 0..(per_lap + per_lap / 2) {
        let lp = if i < per_lap {
            i * bytes
        } else {
            RING + (i - per_lap) * bytes
        };
        let kept = idx.map.contains_key(&(i * 16));
        assert_eq!(kept, lp + RING >= head, "entry {i} at {lp}");
    }
}

#[test]
fn headers_round_trip_and_refuse_other_bytes() {
    let uuid = [7u8; 16];
    let sum = sum_of(b"record");
    let h = encode_header(&uuid, 12345 * 128, 4096, &sum, 4112);
    assert_eq!(
        decode_header(&uuid, &h),
        Some((12345 * 128, 4096, 4112, fingerprint(&sum)))
    );
    assert_eq!(decode_header(&[8u8; 16], &h), None, "another cache's entry");
    for bit in [0, 100, 8 * 64, 8 * 127] {
        let mut bad = h;
        bad[bit / 8] ^= 1 << (bit % 8);
        assert_eq!(decode_header(&uuid, &bad), None, "bit {bit}");
    }
    assert_eq!(decode_header(&uuid, &[0u8; 128]), None);
}

/// A cache device file of `bytes`, zeroed.
fn device_file(dir: &Path, bytes: u64) -> PathBuf {
    let p = dir.join("cache.img");
    std::fs::File::create(&p).unwrap().set_len(bytes).unwrap();
    p
}

#[test]
fn a_cache_device_serves_verified_copies_survives_reopen_and_drops_bad_ones() {
    let dir = tempfile::tempdir().unwrap();
    let path = device_file(dir.path(), 8 << 20);
    let pool = [1u8; 16];
    let records: Vec<(u64, Vec<u8>)> = (0..200u64)
        .map(|i| {
            (
                i * 8192,
                (0..4112).map(|j| (i as usize * 31 + j) as u8).collect(),
            )
        })
        .collect();
    {
        let c = CacheDevice::open(&path, pool, [2; 16]).unwrap();
        let mut out = Vec::new();
        for (addr, rec) in &records {
            assert!(!c.read(*addr, rec.len(), &sum_of(rec), &mut out));
            c.offer(*addr, &sum_of(rec), &[&rec[..100], &rec[100..]]);
        }
        c.settle();
        for (addr, rec) in &records {
            assert!(c.read(*addr, rec.len(), &sum_of(rec), &mut out));
            assert_eq!(&out, rec);
        }
        let st = c.status();
        assert_eq!((st.hits, st.misses, st.errors), (200, 200, 0));
        assert_eq!(st.entries, 200);
        c.close();
    }
    // Reopened: the index is rebuilt from the headers (warm).
    let c = CacheDevice::open(&path, pool, [3; 16]).unwrap();
    c.settle();
    assert_eq!(c.status().entries, 200);
    let mut out = Vec::new();
    assert!(c.read(records[5].0, 4112, &sum_of(&records[5].1), &mut out));
    assert_eq!(out, records[5].1);
    // Damage one entry's bytes on the device: the read fails verification, is counted,
    // and the entry is gone.
    let slot = c
        .index
        .lock()
        .get(records[9].0, &sum_of(&records[9].1), 4112)
        .unwrap();
    let off = c.offset(slot.lp) + CACHEDEV_HEADER_BYTES as u64 + 10;
    c.dev.write_at(&[0xff ^ records[9].1[10]], off).unwrap();
    assert!(!c.read(records[9].0, 4112, &sum_of(&records[9].1), &mut out));
    assert_eq!(c.status().errors, 1);
    assert!(!c.read(records[9].0, 4112, &sum_of(&records[9].1), &mut out));
    assert_eq!(
        c.status().errors,
        1,
        "dropped: a miss now, not a second error"
    );
    c.close();
    // Another pool's label is formatted over; foreign bytes are refused.
    let c = CacheDevice::open(&path, [9; 16], [4; 16]).unwrap();
    c.settle();
    assert_eq!(c.status().entries, 0);
    c.close();
    std::fs::write(&path, vec![0x55u8; 8 << 20]).unwrap();
    assert!(CacheDevice::open(&path, pool, [5; 16]).is_err());
}

#[test]
fn header_and_label_decoders_never_panic_and_keep_their_bounds() {
    let uuid = [7u8; 16];
    let headers: Vec<Vec<u8>> = [
        (0u64, 16u64, 4112u32),
        (1 << 40, 1 << 30, 1),
        (128, 0, 256 << 10),
    ]
    .iter()
    .map(|&(lp, addr, len)| encode_header(&uuid, lp, addr, &sum_of(b"h"), len).to_vec())
    .collect();
    // Re-sealed mutants get past the header's own checksum.
    let reseal = |b: &mut Vec<u8>| {
        if b.len() >= CACHEDEV_HEADER_BYTES {
            let x = checksum::xxh3_64(&b[..120]);
            b[120..128].copy_from_slice(&x.to_le_bytes());
        }
    };
    crate::fuzz::never_panics("cachedev header", &headers, 3000, Some(&reseal), &|b| {
        if let Some((lp, _, len, _)) = decode_header(&uuid, b) {
            assert!(len > 0 && len as usize <= CACHEDEV_RECORD_BYTES_MAX);
            assert!(lp <= CACHEDEV_LOG_POSITION_MAX);
            // What the scan and the index do with it cannot overflow.
            let _ = Index::rebuild(
                RING,
                vec![(lp, entry_bytes(len as usize) as u32, 0, len, 0)],
            );
        }
    });
    let labels = vec![encode_label(&Label {
        uuid,
        pool_id: [1; 16],
        ring: RING,
    })];
    let reseal_label = |b: &mut Vec<u8>| {
        if b.len() == CACHEDEV_LABEL_BYTES {
            let n = CACHEDEV_LABEL_BYTES - 32;
            let sum = checksum::checksum(&b[..n]);
            b[n..].copy_from_slice(&sum);
        }
    };
    crate::fuzz::never_panics("cachedev label", &labels, 2000, Some(&reseal_label), &|b| {
        let _ = decode_label(b);
    });
}

/// The index never holds more entries than its memory budget: while filling (the oldest
/// leave first) and when rebuilt at start from a ring of more (the newest are kept).
#[test]
fn index_stays_within_its_entry_budget() {
    let bytes = entry_bytes(4112);
    let mut idx = Index::with_max(RING, 5);
    for i in 0..12u64 {
        idx.place(bytes, i * 16);
        idx.insert(i * 16, &[7u8; 32], 4112, idx.head - bytes);
        assert!(
            idx.entries() <= 5 && idx.fifo.len() <= 5,
            "{} entries",
            idx.entries()
        );
    }
    // The newest five are found; the older ones are not (their bytes are not trusted to
    // the index any more).
    for i in 0..12u64 {
        let found = idx.get(i * 16, &[7u8; 32], 4112).is_some();
        assert_eq!(found, i >= 7, "entry {i}");
    }
    assert_eq!(idx.used, 5 * bytes);

    let found: Vec<_> = (0..40u64)
        .map(|i| (i * bytes, bytes as u32, i * 16, 4112u32, 7u64))
        .rev()
        .collect();
    let idx = Index::rebuild_max(RING, found, 8);
    assert_eq!(idx.entries(), 8);
    assert!(
        (32..40u64).all(|i| idx.map.contains_key(&(i * 16))),
        "the newest are kept"
    );
    assert_eq!(idx.head, 40 * bytes);
}
