//! Import, phase 5: the intent log replayed (decision 0010): the flushed client writes
//! after the last commit, from the main devices' chain or the log devices', put back in
//! the maps; a chain that goes on past a block that cannot be applied is a loss of
//! acknowledged flushes, said and refused without `accept_log_loss`.
//!
//! Format 1 chains (no MAC) are replayed only by `pool upgrade`. A record a log device
//! carries inline is written back when the main devices lack it. With an object store,
//! the replayed records are uploaded by the import's commit (`build`).

use super::recount::{count_live, Recounted};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::log::segment_of;
use crate::map::Blkptr;
use crate::pool::format::config::PoolConfig;
use crate::pool::format::superblock::{SbKey, Superblock};
use crate::pool::options::OpenOptions;
use crate::store::Store;
use crate::{Error, Result};

/// What the replay did, for the import's commit.
pub(super) struct Replayed {
    pub logdev: Option<Arc<crate::pool::intentlog::devices::LogDevices>>,
    pub chain_slots: Vec<Blkptr>,
    pub replaced: Vec<crate::store::Dead>,
    pub replayed: (u64, usize),
    pub replayed_records: Vec<Blkptr>,
    pub dev_chain: Option<(u64, Arc<crate::pool::intentlog::devices::LogDevices>)>,
    pub dev_slot: u64,
    pub log_loss: Option<String>,
}

/// Phase 5: open the log devices the newest label names, and replay the chain.
#[allow(clippy::too_many_arguments)]
pub(super) fn replay(
    dir: &Path,
    opts: &OpenOptions,
    conf: &PoolConfig,
    newest: &Superblock,
    log_key: &SbKey,
    store: &mut Store,
    r: &mut Recounted<'_>,
) -> Result<Replayed> {
    let Recounted {
        live,
        data_segments,
        families,
        ..
    } = r;
    // The separate log devices the superblock names, found among pool.json's by label.
    let logdev = if newest.log_devices.is_empty() {
        for p in conf.resolve_log(dir) {
            tracing::warn!(
                "{} is listed as a log device in pool.json, but the pool does not use it \
                 (a 'bulwark pool log' change that did not finish); ignored",
                p.display()
            );
        }
        None
    } else {
        let (l, problems) = crate::pool::intentlog::devices::open_all(
            &conf.resolve_log(dir),
            &newest.log_devices,
            &newest.pool_id,
        );
        for p in &problems {
            tracing::warn!("{p}");
        }
        if l.fell_back.load(Ordering::Acquire) {
            *l.note.lock() = Some(format!(
                "no log device could be used at import ({}): flushes commit or use the main \
                 devices' log; 'bulwark pool log remove' forgets the log devices, 'bulwark \
                 pool log add' adds new ones",
                problems.join("; ")
            ));
        }
        Some(Arc::new(l))
    };
    // Replay the intent log: the flushed client writes after the last commit.
    let mut chain_slots: Vec<Blkptr> = Vec::new();
    // Records replayed entries replaced: the committed generation still points at them
    // until the import's own commit, so they are released only after it.
    let mut replaced: Vec<crate::store::Dead> = Vec::new();
    let mut replayed = (0u64, 0usize);
    // The records the replay put back in the maps: with an object store, uploaded by the
    // import's commit (the process that wrote them died before its own could).
    let mut replayed_records: Vec<Blkptr> = Vec::new();
    // The replay stopped at something other than the log's end: said as a warning.
    let mut alarm = false;
    // Format 1 chains (no MAC) are replayed only by `pool upgrade`: the labels that name
    // them were verified by their checksum, not by a key.
    let block_key = (newest.format == crate::pool::format::superblock::VERSION).then_some(log_key);
    // Records written back from the log devices.
    let mut rewritten = 0usize;
    // The chain on the log devices, when this generation's is there and one is readable.
    let dev_chain = match (newest.log_dev_head, &logdev) {
        (Some(head), Some(l)) if l.devices.iter().any(|d| d.dev.is_some()) => {
            Some((head, l.clone()))
        }
        (Some(_), _) => {
            let msg = format!(
                "the intent log of generation {} was on the log devices, and none of them is \
                 here: the writes that FLUSHes made durable after that generation's commit \
                 (at most one commit interval of them, as of the crash) cannot be replayed and \
                 read as they were at that commit; the pool is consistent as of it",
                newest.generation
            );
            tracing::error!("{msg}");
            if let Some(l) = &logdev {
                *l.note.lock() = Some(msg);
            }
            None
        }
        (None, _) => None,
    };
    // On the log devices: the next block, in slots from the head, and the slot it lies at
    // (from the signed links: the superblock's head, then each block's `next`).
    let mut dev_at = 0u64;
    let mut dev_slot = dev_chain.as_ref().map_or(0, |(head, _)| *head);
    let main_head = newest
        .log_head
        .or(dev_chain.as_ref().map(|_| [crate::map::ADDR_NONE; 2]));
    // The loss of acknowledged flushes, found after the replay stopped: a message that
    // names what was lost (`lost_flushes`), refused without `accept_log_loss`.
    let mut log_loss: Option<String> = None;
    if let Some(head) = main_head {
        let mut at = head;
        let mut buf = Vec::new();
        // The block whose entries are being applied (a record that fails stops the replay
        // inside it), and the slot the last applied block named after its next.
        let mut stopped_in: Option<crate::pool::intentlog::block::Block> = None;
        let mut prev_after: Option<[u64; 2]> = None;
        let why = 'replay: loop {
            // The records a block on a log device carries (`logdev`), verified.
            let mut inline = Vec::new();
            let block = if let Some((_, l)) = &dev_chain {
                match l.read_block(
                    dev_slot,
                    dev_at,
                    &newest.pool_id,
                    &newest.chain_id,
                    newest.generation,
                    block_key,
                ) {
                    Ok(Some((b, data))) => {
                        inline = crate::pool::intentlog::devices::inline_records(&b, &data)
                            .into_iter()
                            .map(|r| r.map(<[u8]>::to_vec))
                            .collect();
                        dev_at += 1 + b.data_slots as u64;
                        dev_slot = b.next[0];
                        b
                    }
                    Ok(None) => break "the end of the log".to_string(),
                    Err(e) => {
                        alarm = true;
                        break format!("block {}, which is damaged ({e})", replayed.0);
                    }
                }
            } else {
                let slot = crate::pool::intentlog::block::slot_ptr(at);
                if let Err(e) = store.check_record(&slot) {
                    break format!("block {} has a bad address ({e})", replayed.0);
                }
                chain_slots.push(slot);
                count_live(store, &slot, live);
                let (pool_id, generation, seq) = (newest.pool_id, newest.generation, replayed.0);
                let chain_id = newest.chain_id;
                // A copy with the log's magic that fails its MAC (or is malformed) was not
                // written by this pool's key: replay stops there, and says so loudly.
                let unauthentic = std::cell::Cell::new(false);
                let this_block = |b: &[u8]| match crate::pool::intentlog::block::Block::decode(
                    b, block_key, &pool_id, &chain_id, generation, seq,
                ) {
                    Ok(Some(_)) => true,
                    Ok(None) => false,
                    Err(_) => {
                        unauthentic.set(true);
                        false
                    }
                };
                match store.read_quiet(
                    slot.addrs(),
                    slot.len as usize,
                    &crate::checksum::SELF_CHECKED,
                    &mut buf,
                    &this_block,
                ) {
                    Ok(true) => {}
                    Ok(false) if unauthentic.get() => {
                        alarm = true;
                        break format!(
                            "block {}, which fails authentication under the pool key or is \
                             malformed (altered on the devices?): flushes made after it are \
                             not replayed",
                            replayed.0
                        );
                    }
                    Ok(false) => break "the end of the log".to_string(),
                    Err(e) => {
                        alarm = true;
                        break format!("block {}, which cannot be read ({e})", replayed.0);
                    }
                }
                let block = match crate::pool::intentlog::block::Block::decode(
                    &buf,
                    block_key,
                    &newest.pool_id,
                    &newest.chain_id,
                    newest.generation,
                    replayed.0,
                ) {
                    Ok(Some(b)) => b,
                    Ok(None) => break "the end of the log".to_string(),
                    Err(e) => {
                        alarm = true;
                        break format!("block {}, which is damaged ({e})", replayed.0);
                    }
                };
                block
            };
            stopped_in = Some(block.clone());
            for (i, e) in block.entries.iter().enumerate() {
                let Some(f) = families.iter_mut().find(|f| f.rec.id == e.volume) else {
                    break 'replay format!(
                        "block {} entry {i} names volume id {}, which the table does not have",
                        replayed.0, e.volume
                    );
                };
                let blocks = f.rec.size_bytes / f.rec.block_size as u64;
                if e.lba >= blocks {
                    break 'replay format!(
                        "block {} entry {i} is past the end of volume '{}'",
                        replayed.0, f.rec.name
                    );
                }
                if !e.ptr.is_hole() {
                    // The record must be there, whole: a flush that never returned may have
                    // left its log block durable without it.
                    if let Err(err) = store.check_record(&e.ptr) {
                        break 'replay format!("block {} entry {i}: {err}", replayed.0);
                    }
                    let mut rec = Vec::new();
                    let on_devices = store
                        .read_quiet(
                            e.ptr.addrs(),
                            e.ptr.len as usize,
                            &e.ptr.checksum,
                            &mut rec,
                            &|_| true,
                        )
                        .unwrap_or(false);
                    match inline.get(i) {
                        // The log device carries it (the main devices were not synced):
                        // written back on every member, even when a copy verifies (one torn
                        // elsewhere would leave a flushed write one member from lost: F2),
                        // made durable by the import's commit; a replay again does the same.
                        Some(Some(bytes)) => {
                            for &a in e.ptr.addrs() {
                                if let Err(err) = store.write_at(a, bytes) {
                                    break 'replay format!(
                                        "block {} entry {i}: its record cannot be written back \
                                         from the log device ({err})",
                                        replayed.0
                                    );
                                }
                            }
                            rewritten += 1;
                        }
                        _ if on_devices => rewritten += mend(store, &e.ptr, &mut rec),
                        _ => {
                            break 'replay format!(
                                "block {} entry {i}: the record it names is not on the devices \
                                 (a flush that never finished)",
                                replayed.0
                            )
                        }
                    }
                }
                let old = match f.tree.set(&*store, store.nodes(), e.lba, e.ptr) {
                    Ok(old) => old,
                    Err(err) => break 'replay format!("block {} entry {i}: {err}", replayed.0),
                };
                count_live(store, &e.ptr, live);
                if !e.ptr.is_hole() {
                    replayed_records.push(e.ptr);
                }
                for &a in e.ptr.addrs() {
                    if let Some(d) = data_segments.get_mut(segment_of(a) as usize) {
                        *d = true;
                    }
                }
                f.used = (f.used + e.ptr.len as u64).saturating_sub(old.len as u64);
                replaced.extend(crate::volume::snap::head_drops(
                    store,
                    &f.snaps,
                    crate::map::At::Data(e.lba),
                    &old,
                ));
                replayed.1 += 1;
            }
            stopped_in = None;
            replayed.0 += 1;
            prev_after = Some(block.after);
            at = block.next;
        };
        // Did the chain go on past where the replay stopped? A later block of this chain
        // written by a later flush proves that the flush the replay stopped in returned:
        // what it and every flush after it made durable is lost, not unfinished.
        let k = match (&stopped_in, &dev_chain) {
            (Some(b), _) => b.seq,
            (None, Some(_)) => dev_at,
            (None, None) => replayed.0,
        };
        let later: Vec<crate::pool::intentlog::block::Block> = match &dev_chain {
            Some((_, l)) => l.blocks_after(
                k,
                &newest.pool_id,
                &newest.chain_id,
                newest.generation,
                block_key,
            ),
            None => {
                let mut starts = Vec::new();
                match &stopped_in {
                    Some(b) => {
                        starts.push((k + 1, b.next));
                        starts.push((k + 2, b.after));
                    }
                    None => starts.extend(prev_after.map(|a| (k + 1, a))),
                }
                later_main_blocks(store, starts, newest, block_key)
            }
        };
        let reach = match crate::pool::format::anchor::read_reach(dir) {
            Some(r) if r.generation == newest.generation && r.chain == newest.chain_id => {
                Some(r.blocks)
            }
            _ => None,
        };
        // On the log devices a block's sequence number counts slots; `replayed.0` counts
        // blocks on the main devices. The reach record counts what `Chain::seq` counts.
        let reached = if dev_chain.is_some() {
            dev_at
        } else {
            replayed.0
        };
        let proof = later.iter().any(|b| b.proves_acknowledged(k));
        let short = reach.filter(|&r| r > reached);
        if proof || short.is_some() {
            let mut names: Vec<String> = later
                .iter()
                .flat_map(|b| b.entries.iter().map(|e| e.volume))
                .chain(
                    stopped_in
                        .iter()
                        .flat_map(|b| b.entries.iter().map(|e| e.volume)),
                )
                .filter_map(|id| families.iter().find(|f| f.rec.id == id))
                .map(|f| f.rec.name.clone())
                .collect();
            names.sort();
            names.dedup();
            let mut flushes: Vec<u64> = later
                .iter()
                .filter(|b| b.proves_acknowledged(k))
                .map(|b| b.flush_first)
                .collect();
            flushes.sort();
            flushes.dedup();
            let lost_flushes = flushes.len() + 1;
            let evidence = match (proof, short) {
                (true, _) => format!(
                    "{} later block(s) of the same chain verify under the pool key",
                    later.len()
                ),
                (false, Some(r)) => format!(
                    "the host's anchor records that the log reached {r} (it stops at {reached})"
                ),
                (false, None) => unreachable!(),
            };
            let volumes = if names.is_empty() {
                "volumes not known (the blocks that named them are gone)".to_string()
            } else {
                format!("volume(s) {}", names.join(", "))
            };
            // Not "a flush that never finished": a later flush returned after it.
            let why = why.replace(" (a flush that never finished)", "");
            log_loss = Some(format!(
                "the intent log of generation {} stops at {why}, but the chain goes on: \
                 {evidence}. At least {lost_flushes} acknowledged FLUSH(es) after block {k} \
                 are lost ({volumes}): their writes read as they were before them. The log \
                 was altered or damaged on the devices{}",
                newest.generation,
                if dev_chain.is_some() {
                    " or the log device"
                } else {
                    ""
                },
            ));
        }
        if let Some(msg) = &log_loss {
            tracing::warn!(blocks = replayed.0, entries = replayed.1, "{msg}");
            if !opts.accept_log_loss {
                return Err(Error::Corrupt(format!(
                    "{msg}. Nothing was committed. Restore the devices{} as they were, or take \
                     the pool without those flushes with 'bulwark serve --accept-log-loss' \
                     (audited)",
                    if dev_chain.is_some() {
                        " and the log device"
                    } else {
                        ""
                    },
                )));
            }
        } else if alarm {
            tracing::warn!(
                blocks = replayed.0,
                entries = replayed.1,
                "intent log replay stopped at {why}"
            );
        } else if replayed.0 > 0 {
            tracing::info!(
                blocks = replayed.0,
                entries = replayed.1,
                records_written_back = rewritten,
                "intent log replayed{}: flushed writes since generation {} restored; stopped at {why}",
                if dev_chain.is_some() { " from the log devices" } else { "" },
                newest.generation
            );
        } else {
            tracing::debug!("intent log empty: {why}");
        }
    }
    Ok(Replayed {
        logdev,
        chain_slots,
        replaced,
        replayed,
        replayed_records,
        dev_chain,
        dev_slot,
        log_loss,
    })
}

/// The blocks of `newest`'s chain on the main devices reachable from `starts` (each a
/// sequence number and the slot that block would lie at), following every block's `next`
/// and `after`: what lies past a block the replay could not apply. Bounded by
/// `LATER_BLOCKS_MAX` reads.
fn later_main_blocks(
    store: &Store,
    starts: Vec<(u64, [u64; 2])>,
    newest: &Superblock,
    key: Option<&crate::pool::intentlog::block::LogKey>,
) -> Vec<crate::pool::intentlog::block::Block> {
    const LATER_BLOCKS_MAX: usize = 1 << 16;
    let mut todo = starts;
    let mut seen = std::collections::HashSet::new();
    let mut found = std::collections::BTreeMap::new();
    let mut buf = Vec::new();
    while let Some((seq, slot)) = todo.pop() {
        if seen.len() >= LATER_BLOCKS_MAX || !seen.insert((seq, slot)) || found.contains_key(&seq) {
            continue;
        }
        let ptr = crate::pool::intentlog::block::slot_ptr(slot);
        if slot[0] == crate::map::ADDR_NONE || store.check_record(&ptr).is_err() {
            continue;
        }
        let decode = |b: &[u8]| {
            crate::pool::intentlog::block::Block::decode(
                b,
                key,
                &newest.pool_id,
                &newest.chain_id,
                newest.generation,
                seq,
            )
        };
        let ok = store.read_quiet(
            ptr.addrs(),
            ptr.len as usize,
            &crate::checksum::SELF_CHECKED,
            &mut buf,
            &|b| matches!(decode(b), Ok(Some(_))),
        );
        if !matches!(ok, Ok(true)) {
            continue;
        }
        if let Ok(Some(b)) = decode(&buf) {
            todo.push((seq + 1, b.next));
            todo.push((seq + 2, b.after));
            found.insert(seq, b);
        }
    }
    found.into_values().collect()
}

/// A record the replay takes from the main devices, one copy of which verified: a power
/// loss may have torn another (a mirror's other member), so every copy is read and the
/// torn ones are written whole from it now; otherwise a member lost later takes the write
/// with it (F5). 1 when a copy was written back.
fn mend(store: &crate::store::Store, p: &crate::map::Blkptr, buf: &mut Vec<u8>) -> usize {
    usize::from(store.scrub_local(p, buf).repaired > 0)
}
