//! Seeds that found a bug, kept as regression tests once it was fixed (each runs in a
//! second or two in a release build).

use bulwark_sim::{run, Config, SimLayout, LATER_KINDS};

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

fn holds(seed: u64, ops: u64, layout: SimLayout) {
    let cfg = Config {
        seed,
        ops,
        layout,
        dir: None,
        log: false,
        // The run as it was when the bug was found: without the kinds added since.
        without: LATER_KINDS.iter().map(|(k, _)| *k).collect(),
    };
    if let Err(f) = run(&cfg) {
        panic!("op {}: {}\nreplay: {}", f.op, f.message, f.replay);
    }
}
