//! One seed is one run: the same seed, run twice, gives the same trace hash (every
//! operation, argument and answer), the same counts and the same bytes on its devices,
//! on every layout (the object tier's included: its store's faults are the seed's
//! whatever the upload threads do).

use bulwark_sim::{run, run_with_device_hash, Config, SimLayout};

fn config(seed: u64, layout: SimLayout) -> Config {
    Config {
        seed,
        ops: 400,
        layout,
        dir: None,
        log: false,
        without: Vec::new(),
    }
}

#[test]
fn a_seed_replays_identically() {
    for (seed, layout) in [
        (7, SimLayout::Single),
        (8, SimLayout::Mirror),
        (9, SimLayout::Parity),
        (10, SimLayout::Log),
        (11, SimLayout::Tier),
        // A 64-node map cache (`tiny_node_cache`): which node a full cache evicts, and so
        // which reads reach the devices (and the seed's faults), is the same every run.
        (16, SimLayout::Mirror),
    ] {
        let (a, a_bytes) =
            run_with_device_hash(&config(seed, layout)).unwrap_or_else(|f| panic!("{f:?}"));
        let (b, b_bytes) =
            run_with_device_hash(&config(seed, layout)).unwrap_or_else(|f| panic!("{f:?}"));
        assert_eq!(
            a.trace_hash, b.trace_hash,
            "seed {seed} {layout:?} ran differently twice"
        );
        assert_eq!(format!("{:?}", a.stats), format!("{:?}", b.stats));
        if seed == 16 {
            assert_eq!(
                a.stats.tiny_node_cache, 1,
                "seed 16 no longer draws the small cache"
            );
        }
        // The same bytes in the same places: nonces, salts, keys and timestamps come from
        // the seed (`bulwark_engine::env`), so a seeded fault hits the same I/O each time.
        assert_eq!(
            a_bytes, b_bytes,
            "seed {seed} {layout:?} left different bytes on its devices"
        );
        // A different seed is a different run (the hash sees the operations).
        let c = run(&config(seed + 1000, layout)).unwrap_or_else(|f| panic!("{f:?}"));
        assert_ne!(a.trace_hash, c.trace_hash);
    }
}
