//! Seeds that found a bug, kept as regression tests once it was fixed (each runs in a
//! second or two in a release build).

use bulwark_sim::{run, Config, Kind, SimLayout, LATER_KINDS};

/// F1 (found by the simulator's first long run, issue 37): a commit released a map node
/// twice, panicking with `segment 17 live count underflow (942 - 1080)` at operation 683
/// (`commit_snapshot_trees` releasing a snapshot tree's replaced node). The cleaner moved a
/// level-1 node by `Tree::touch`, which also dirtied the first leaf below it in each tree
/// of the run; each tree then wrote its own copy of that leaf, while the trees outside the
/// run (the head, a clone's base) kept the old one. The trees holding the old leaf were no
/// longer one unbroken run, so the head's commit (which asks only the newest snapshot) and
/// the base's both released it. `map::tests::touch_leaves_the_nodes_below_shared` tests
/// the cause directly.
#[test]
fn f1_seed_10_single() {
    holds(10, 1000, SimLayout::Single);
}

/// F1 on `parity:2+1` (`segment 13 live count underflow (272 - 304)` at operation 1279).
#[test]
fn f1_seed_1025_parity() {
    holds(1025, 3000, SimLayout::Parity);
}

/// F1 on `mirror:2` (operation 1042), with no crash in the run.
#[test]
fn f1_seed_3021_mirror() {
    holds(3021, 1500, SimLayout::Mirror);
}

/// F1 on `parity:2+1` (operation 906).
#[test]
fn f1_seed_3003_parity() {
    holds(3003, 1500, SimLayout::Parity);
}

/// F2 (found by the long run of 2026-12-03 once faults and device operations came):
/// after a power loss a mirror or parity pool with a separate log device could hold a
/// flushed record whole on one member only, and losing that member before a scrub lost
/// it. Seed 2040 on `mirror:2`: member 0 vanishes at operation 792 (`Kind::Device`);
/// from then on `v1` bytes 2908160..2916352 read "unrecoverable block: no copy verified"
/// (member 1's copy fails its checksum). A small flush puts its records' bytes into the
/// log device block and does not sync the main devices; the import's replay wrote them
/// back only when no copy verified, so a copy torn on one member (the crash keeping it on
/// the other) stayed torn. The replay now writes them back on every member.
/// `txg::logdev::tests::a_replay_rewrites_a_small_flush_on_every_member` tests the cause.
#[test]
fn f2_seed_2040_mirror() {
    holds_all(2040, 900, SimLayout::Mirror);
}

/// F2 on `parity:2+1`: member 2 vanishes at operation 1586; after the restart at 1589
/// `v37` bytes 819200..835584 read "no copy verified".
#[test]
fn f2_seed_2040_parity() {
    holds_all(2040, 1600, SimLayout::Parity);
}

/// F2 on `parity:2+1` again (the long run, chunk from seed 2075): member 1 vanishes,
/// a crash at operation 221 leaves it stale, and `v1` bytes 135168..139264 read "no copy
/// verified".
#[test]
fn f2_seed_2089_parity() {
    holds_all(2089, 230, SimLayout::Parity);
}

/// F3 (the first long run of the `tier` layout): a crash inside a maintenance step that
/// was bringing a given-back segment back from the object store (`Core::bring_back`) left
/// it neither a hole nor whole; reads took its records from the store ("no local copy
/// verified"), and the scrub at operation 1085 called 28 of them unrecoverable. The scrub
/// now judges such a record by the store's copy (`Store::scrub_record`).
/// `tier::pool_tests::a_scrub_takes_the_stores_copy_of_a_segment_half_brought_back` tests
/// the cause.
#[test]
fn f3_seed_177_tier() {
    holds_all(177, 1100, SimLayout::Tier);
}

/// F4 (the same run): every commit the object store refused leaked the volume table
/// record it had written, so a clean restart at operation 632 recounted 78 KB less than
/// the pool counted while running. `tier::pool_tests::a_refused_commit_leaks_no_space`
/// tests the cause.
#[test]
fn f4_seed_279_tier() {
    holds_all(279, 640, SimLayout::Tier);
}

/// F5 (found 2026-12-04 by `--seeds 440 --first 60000 --ops 1500 --layout all`): a crash
/// inside a FLUSH (op 1359) left a block's new record whole on member 0 of a mirror and
/// torn on member 1, with its intent log block durable. The replay took the record because
/// one copy verified, and left the torn one as it was; when member 0 was later taken
/// offline (op 1402), the only copy left failed its checksum, and a read after the next
/// crash answered "unrecoverable block". The replay now reads every copy of a record it
/// takes from the main devices and writes the torn ones whole from the one that verified
/// (`import/replay.rs`), as F2's fix does for records the log device carries.
#[test]
fn f5_seed_60213_mirror() {
    holds_all(60213, 1500, SimLayout::Mirror);
}

/// F6 (found 2026-12-04, seed 710054, parity): a double release of a map leaf. Clones
/// c31 of v2@s25 and c35 of v2@s33 had bases that still shared a leaf after v2's key
/// rotations gave v2's own trees new leaves there. When c35's rotation finished and it
/// detached from its origin (op 1293), its base's leaves were released against v2@s33
/// alone, and this one went although c31's base held it; the cleaner later rewrote c31's
/// base there (op 1385) and released it again. Between the two, the segment counted 704
/// bytes fewer than it held: had it fallen to zero it would have been freed under c31's
/// base. The base now goes against every tree of the clone graph
/// (`release_family_base`), and a record the cleaner moves stays while such a tree
/// holds it (`Core::dropped_in_family`).
#[test]
fn f6_seed_710054_parity() {
    holds_all(710054, 1500, SimLayout::Parity);
}

/// F7 (found 2026-12-04, seed 720115, tier): after a real takeover (another host opened
/// the pool from the bucket), a write that waited for space ran the maintenance round
/// whose commit found the pool fenced and poisoned it; the FLUSH after it answered a bare
/// `Poisoned` instead of `Fenced` naming the new holder. A pool poisoned by fencing now
/// keeps the reason (`Store::poison_for`), and every later operation answers it.
#[test]
fn f7_seed_720115_tier() {
    holds_all(720115, 900, SimLayout::Tier);
}

/// Not an engine bug: the simulator's own (found 2026-12-05 by the campaign from seed
/// 9500000, at op 1429 of seed 9500096, tier). A resize of huge volume v44 from 850 to 888
/// cells kept its size (the new cells lay in its last island), so the engine committed
/// nothing, yet the model counted the resize as a commit and every write since as
/// durable; the restore from the bucket then rightly read cell 179 of v13 as the last
/// committed value (12865), not the unflushed 13127. The model now counts a resize that
/// keeps the size as nothing.
#[test]
fn s1_seed_9500096_tier() {
    // As it was found: scattered volumes, fills, overwrite bursts and holes first came later.
    let later = [
        Kind::ScatterCreate,
        Kind::Fill,
        Kind::Overwrite,
        Kind::HolesFirst,
    ];
    holds_without(9500096, 1500, SimLayout::Tier, &later);
}

/// Issue 36's endless wait, found by the simulator (2026-12-05) with the wait rule of
/// before its fix put back (`docs/experiments/issue36-endless-wait.patch`, holes off): a
/// write at op 3249 of seed 1047 on `mirror:2` (a member offline, the pool filled by
/// whole-volume fills and random overwrite bursts, `Kind::Fill` and `Kind::Overwrite`)
/// waited 200 simulated seconds, where the experiment cut it: every cleaning round freed
/// segments, so the wait's deadline moved on, and the moves and their map nodes took them
/// again (free 20 against a floor of 20). Under today's rule (net gain only, a bound on
/// the whole wait, stuck cleaning refused at once) the seed holds, holes on or off.
#[test]
fn w1_seed_1047_mirror() {
    // Every kind there was when it was found; kinds added later go here.
    holds_without(1047, 3300, SimLayout::Mirror, &[Kind::HolesFirst]);
}

fn holds(seed: u64, ops: u64, layout: SimLayout) {
    // The run as it was when the bug was found: without the kinds added since.
    let later: Vec<Kind> = LATER_KINDS
        .iter()
        .map(|(k, _)| *k)
        .chain([Kind::SmallCache, Kind::HolesFirst])
        .collect();
    holds_without(seed, ops, layout, &later);
}

/// A seed with every kind of operation the seed draws (F2 needs the later ones).
fn holds_all(seed: u64, ops: u64, layout: SimLayout) {
    // Kinds added after these seeds were found: the runs stay as they were then.
    let later = [
        Kind::Idle,
        Kind::HugeCreate,
        Kind::SmallCache,
        Kind::ScatterCreate,
        Kind::Fill,
        Kind::Overwrite,
        Kind::HolesFirst,
    ];
    holds_without(seed, ops, layout, &later);
}

/// Run `seed` for `ops` operations on `layout` with the kinds in `without` off; a failure
/// panics with the line that replays it.
fn holds_without(seed: u64, ops: u64, layout: SimLayout, without: &[Kind]) {
    let cfg = Config {
        seed,
        ops,
        layout,
        dir: None,
        log: false,
        without: without.to_vec(),
    };
    if let Err(f) = run(&cfg) {
        panic!("op {}: {}\nreplay: {}", f.op, f.message, f.replay);
    }
}
