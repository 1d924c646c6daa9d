//! The simulator in CI: a fixed budget of seeds per layout (a few tens of seconds in a
//! release build). `BULWARK_SIM_SEEDS` and `BULWARK_SIM_OPS` run more; a failure names
//! the command line that replays it.

use bulwark_sim::{run, Config, SimLayout};

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .map(|s| {
            s.parse()
                .unwrap_or_else(|_| panic!("{name}={s} is not a number"))
        })
        .unwrap_or(default)
}

fn budget(layout: SimLayout) {
    // Parity costs three times the others a seed (every scrub, resilver and repair
    // reconstructs from the other members): fewer seeds keep CI's time.
    let seeds = env(
        "BULWARK_SIM_SEEDS",
        if layout == SimLayout::Parity { 10 } else { 16 },
    );
    let ops = env("BULWARK_SIM_OPS", 500);
    let mut crashes = 0;
    let mut huge = 0;
    let mut scattered = 0;
    let mut tiny = 0;
    let mut bursts = (0, 0);
    let mut holes_first = 0;
    let mut tier = (0, 0, 0);
    for seed in 1..=seeds {
        let cfg = Config {
            seed,
            ops,
            layout,
            dir: None,
            log: false,
            without: Vec::new(),
        };
        match run(&cfg) {
            Ok(r) => {
                crashes += r.stats.crashes;
                huge += r.stats.huge_volumes;
                scattered += r.stats.scattered_volumes;
                tiny += r.stats.tiny_node_cache;
                bursts.0 += r.stats.fills;
                bursts.1 += r.stats.overwrites;
                holes_first += r.stats.holes_first;
                tier.0 += r.stats.store_commits_failed;
                tier.1 += r.stats.fenced;
                tier.2 += r.stats.restores;
            }
            Err(f) => panic!(
                "seed {} {layout:?} failed at op {}: {}\nreplay: {}",
                f.seed, f.op, f.message, f.replay
            ),
        }
    }
    // The budget exercises crashes, or it does not test what it says it does.
    assert!(crashes > 0, "{seeds} seeds of {layout:?} crashed no pool");
    // And terabyte thin volumes with deep, sparse maps (`Kind::HugeCreate`).
    assert!(
        huge > 0,
        "{seeds} seeds of {layout:?} created no huge volume"
    );
    // And maps bigger than their data: a leaf per block (`Kind::ScatterCreate`).
    assert!(
        scattered > 0,
        "{seeds} seeds of {layout:?} created no scattered volume"
    );
    // And a node cache too small to hold the maps (`World::tiny_node_cache`).
    assert!(
        tiny > 0,
        "{seeds} seeds of {layout:?} ran no pool with a 64-node map cache"
    );
    // And disks written whole, then overwritten at random (`Kind::Fill`, `Kind::Overwrite`).
    assert!(
        bursts.0 > 0 && bursts.1 > 0,
        "{seeds} seeds of {layout:?}: {} whole-volume fills, {} overwrite bursts",
        bursts.0,
        bursts.1
    );
    // And holes first (`serve --holes-first`), except on the tier, which fills no holes.
    assert!(
        holes_first > 0 || layout == SimLayout::Tier,
        "{seeds} seeds of {layout:?} ran no pool with holes first"
    );
    if layout == SimLayout::Tier {
        // And the object store's faults: refused flushes, fencings, restores.
        let t = tier;
        assert!(
            t.0 > 0 && t.1 > 0 && t.2 > 0,
            "{seeds} seeds of the tier: {} flushes refused by the store, {} fencings, {} \
             restores",
            t.0,
            t.1,
            t.2
        );
    }
}

#[test]
fn single_holds() {
    budget(SimLayout::Single);
}

#[test]
fn mirror_holds() {
    budget(SimLayout::Mirror);
}

#[test]
fn parity_holds() {
    budget(SimLayout::Parity);
}

#[test]
fn log_device_holds() {
    budget(SimLayout::Log);
}

#[test]
fn object_tier_holds() {
    budget(SimLayout::Tier);
}
