//! Layers you can see: each top-level module of a crate may use only the
//! modules its row in that crate's table names, and every row names only
//! rows above it (the tables list modules bottom-up), so the modules form a
//! DAG in the order written here. A new import between modules fails this
//! test until the table says it is meant; so does a module missing from its
//! table, a row for a module that is gone, and a row that allows more than
//! the module uses (the tables are the module graph, not an upper bound).
//!
//! What counts as a use, read from the source text (comments and string
//! literals left out): `crate::X` anywhere (in `use` lists too:
//! `use crate::{X, Y::Z}`), and `super::…` paths that climb out of their
//! module to the crate root. Code under `#[cfg(test)]` counts like any other.
//!
//! This is a test, not a lint: it runs with `cargo test -p bulwark` and says
//! which line broke which rule.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// One crate's table.
struct Table {
    /// The crate's source folder, relative to this crate's manifest (or, for a folder
    /// inside a crate, that folder).
    src: &'static str,
    /// For a folder inside a crate: its module path below the crate root (`["pool"]` for
    /// `crate::pool`); empty for a crate. Only uses that stay inside the folder are checked
    /// here (the crate's own table checks the rest).
    within: &'static [&'static str],
    /// Root items (the folder's re-exports) that only test code may use: a room below the
    /// facade may open a pool through it in its tests, never in its code.
    tests_only: &'static [&'static str],
    /// The crate root's file stem (`lib` or `main`); the root may use every module.
    root: &'static str,
    /// Names in the crate root that are not modules but that any module may
    /// use (`crate::Error` re-exported from a module, an external crate
    /// under a short name), each with why; a use of any other root name fails.
    root_items: &'static [(&'static str, &'static str)],
    /// Bottom-up: each module and the modules it uses, all of them listed above it.
    layers: &'static [(&'static str, &'static [&'static str])],
}

/// `bulwark-nbd`: knows NBD, nothing of volumes.
const NBD: Table = Table {
    within: &[],
    tests_only: &[],
    src: "../nbd/src",
    root: "lib",
    root_items: &[],
    layers: &[
        // Bounds and knobs: what a client may make the server hold or wait on.
        ("limits", &[]),
        // What the server calls: `Backend`, `Exports`, `Identity`, errno values.
        ("backend", &[]),
        // The wire: constants and a pure codec.
        ("proto", &["limits"]),
        // A blocking client that reads one export (`bulwark image import`'s digest).
        ("reader", &["proto"]),
        // Parts the phases share.
        ("buffers", &["limits"]),
        ("ratelimit", &["limits"]),
        ("workers", &["limits"]),
        ("tls", &["backend"]),
        // Option haggling; its outcome, `Negotiated`, is what the phases below serve.
        ("handshake", &["backend", "limits", "proto", "ratelimit"]),
        // One request: parse, validate, run, reply; both transmission paths use it.
        (
            "request",
            &["backend", "buffers", "handshake", "limits", "proto"],
        ),
        // The two transmission paths: async (TLS streams) and threaded (plain sockets).
        (
            "transmission",
            &[
                "buffers",
                "handshake",
                "limits",
                "proto",
                "request",
                "workers",
            ],
        ),
        (
            "direct",
            &["buffers", "handshake", "limits", "proto", "request"],
        ),
        // Accepts, runs each connection through the phases, tracks them.
        (
            "server",
            &[
                "backend",
                "buffers",
                "direct",
                "handshake",
                "limits",
                "proto",
                "ratelimit",
                "request",
                "tls",
                "transmission",
            ],
        ),
    ],
};

/// `bulwark`, the binary: the CLI and the daemon.
const BULWARK: Table = Table {
    within: &[],
    tests_only: &[],
    src: "src",
    root: "main",
    root_items: &[],
    layers: &[
        // The binary's error type.
        ("error", &[]),
        // Grants and the audit log (files in the pool directory).
        ("access", &[]),
        // sd_notify: readiness for systemd's Type=notify.
        ("notify", &[]),
        // Arguments.
        ("cli", &["error"]),
        // Prometheus metrics: counters the I/O path bumps, the pool read at scrape
        // time, the HTTP endpoint.
        ("metrics", &["error"]),
        // The control protocol, both sides' vocabulary.
        ("control", &["access"]),
        // Text for people.
        ("display", &["control"]),
        // Talking to the daemon; the plain commands.
        ("client", &["cli", "control", "display", "error"]),
        // Volumes as NBD exports.
        ("export", &["access", "metrics"]),
        // Commands with both sides: the CLI half and the daemon's `handle`.
        ("grant", &["access", "cli", "client", "control", "error"]),
        // The audit log read back for people (the file itself, no daemon).
        ("history", &["access", "cli", "client", "display", "error"]),
        ("keys", &["cli", "client", "control", "display", "error"]),
        (
            "maintenance",
            &["cli", "client", "control", "display", "error"],
        ),
        ("bench", &["cli", "client", "control", "error"]),
        // Snapshots, rollback and `volume list --space`.
        (
            "snapshot",
            &["cli", "client", "control", "display", "error"],
        ),
        // Volume resize and properties (get, set): both sides.
        ("volume", &["cli", "client", "control", "display", "error"]),
        // `bulwark csi`: the CSI driver's `Pool` answered over the control socket.
        ("csi", &["cli", "client", "control", "error"]),
        // Disk images in and out of volumes (qemu-img, NBD): the CLI side only.
        (
            "image",
            &["cli", "client", "control", "display", "error", "snapshot"],
        ),
        // The object store from the binary's side: the client a pool names, the probe.
        ("objects", &["cli", "error"]),
        // Pool life cycle without a daemon (create, list, status, export, import, destroy)
        // and the host's registry of pools.
        (
            "pools",
            &[
                "access", "cli", "client", "control", "display", "error", "image", "objects",
            ],
        ),
        // The daemon: serves the pool, dispatches control requests to the handlers above.
        (
            "daemon",
            &[
                "access",
                "cli",
                "control",
                "error",
                "export",
                "grant",
                "keys",
                "maintenance",
                "metrics",
                "notify",
                "objects",
                "volume",
            ],
        ),
    ],
};

/// `bulwark-csi`: the CSI driver; knows gRPC and the node's mounts, reaches the pool
/// only through its `Pool` trait.
const CSI: Table = Table {
    within: &[],
    tests_only: &[],
    src: "../csi/src",
    root: "lib",
    root_items: &[],
    layers: &[
        // The generated messages and services.
        ("proto", &[]),
        // What the driver needs from the daemon.
        ("pool", &[]),
        // CSI names and ids as bulwark names.
        ("ids", &[]),
        // StorageClass parameters.
        ("params", &[]),
        // File systems and mounts (system tools).
        ("mount", &[]),
        // CSI secrets as short-lived 0600 files.
        ("secret", &["pool"]),
        // NBD exports as block devices (kernel client, or nbdfuse and a loop device).
        ("attach", &["mount"]),
        ("caps", &["mount", "proto"]),
        // Failures as gRPC status codes.
        ("status", &["mount", "pool"]),
        // What the services share: configuration, the pool, per-volume locks.
        ("driver", &["pool", "proto"]),
        // The three services.
        ("identity", &["driver", "proto"]),
        (
            "controller",
            &[
                "caps", "driver", "ids", "params", "pool", "proto", "secret", "status",
            ],
        ),
        (
            "node",
            &[
                "attach", "caps", "driver", "mount", "pool", "proto", "secret", "status",
            ],
        ),
    ],
};

/// `bulwark-sim`: the deterministic simulator (docs/simulation.md).
const SIM: Table = Table {
    within: &[],
    tests_only: &[],
    src: "../sim/src",
    root: "lib",
    root_items: &[],
    layers: &[
        // The seeded generator and the trace hash.
        ("rng", &[]),
        // The reference model: what each cell may read as, now and after a crash.
        ("model", &[]),
        // The simulated object store (S3) of the `tier` layout, its faults.
        ("objects", &[]),
        // The world: the pool, the driver of operations, steps and crashes.
        ("world", &["model", "rng", "objects"]),
        // The live run: the engine on its real threads, checked with the model's cells.
        ("live", &["model", "rng"]),
        // The command lines (the binaries; they reach the rest as `bulwark_sim::`).
        ("main", &[]),
        ("bin", &[]),
    ],
};

/// `bulwark-engine`: the storage engine, bottom up as ARCHITECTURE.md draws it.
const ENGINE: Table = Table {
    within: &[],
    tests_only: &[],
    src: "../engine/src",
    root: "lib",
    root_items: &[
        ("Error", "the engine's error type, re-exported from `error`"),
        ("Result", "its result alias, re-exported from `error`"),
    ],
    layers: &[
        // Leaves: errors, on-disk constants, checksums, hex text, sizes, fuzz helpers.
        ("error", &[]),
        ("constants", &[]),
        ("checksum", &[]),
        ("hex", &[]),
        ("size", &[]),
        ("fuzz", &[]),
        // Named crash points for tests (`BULWARK_CRASH_AT`).
        ("crashpoint", &[]),
        // The clock, sleeping and randomness, simulated by `bulwark-sim` (issue 37).
        ("env", &[]),
        // Named pause points for tests (a thread stopped at one step).
        ("pause", &["env"]),
        // The locks and atomics of the model-checked protocols (`log`, `store::gate`):
        // parking_lot's and std's here, shuttle's in `bulwark-modelcheck`.
        ("sync", &[]),
        // What the pool needs from an object store (the client is `bulwark-objstore`).
        ("tier", &[]),
        // Devices by byte offset (files, block devices, fault injection).
        ("device", &["env", "constants"]),
        // Where copies and shards of a record lie; verified reads that repair.
        ("redundancy", &["env", "checksum", "constants", "device"]),
        // Copies of hot records on a cache device (an L2ARC), verified at every hit.
        (
            "cachedev",
            &["env", "checksum", "constants", "device", "fuzz", "hex"],
        ),
        // Segments, streams, space floors, victims for the cleaner.
        ("log", &["constants", "sync"]),
        // lz4 and AES-256-GCM of one record.
        ("codec", &["constants", "fuzz"]),
        // Key slots, data key rings, the pool key.
        ("keys", &["env", "codec", "hex"]),
        // The copy-on-write radix tree of block pointers.
        ("map", &["checksum", "codec", "constants", "fuzz"]),
        // The data plane: one put path, one release point, back-pressure.
        (
            "store",
            &[
                "env",
                "cachedev",
                "checksum",
                "codec",
                "constants",
                "log",
                "map",
                "redundancy",
                "sync",
            ],
        ),
        // Byte-addressed reads and writes of one volume, through the store only (`size`:
        // sizes in its messages; `sync`: the locks of `volume/uses.rs` and `stripes.rs`,
        // model-checked).
        (
            "volume",
            &[
                "env",
                "checksum",
                "codec",
                "constants",
                "keys",
                "log",
                "map",
                "size",
                "store",
                "sync",
            ],
        ),
        // The control plane: volumes, devices, commits, import, scrub, rotation.
        (
            "pool",
            &[
                "env",
                "cachedev",
                "checksum",
                "codec",
                "constants",
                "crashpoint",
                "device",
                "pause",
                "fuzz",
                "hex",
                "keys",
                "log",
                "map",
                "redundancy",
                "size",
                "store",
                "sync",
                "tier",
                "volume",
            ],
        ),
    ],
};

/// The engine's control plane, `crates/engine/src/pool/`, room by room (issue 38): the
/// bytes and files it keeps at the bottom, the state below `Core`, `Core`, the rooms that
/// act on it, the pool's life, and `facade` (`Pool`) on top. `mod.rs` only declares and
/// re-exports; its re-exports are for tests.
const POOL: Table = Table {
    src: "../engine/src/pool",
    root: "mod",
    within: &["pool"],
    tests_only: &[
        "Pool",
        "OpenOptions",
        "DeviceSpec",
        "Layout",
        "test_pool",
        "test_volume",
    ],
    root_items: &[
        (
            "Pool",
            "the facade, re-exported: tests open a pool through it",
        ),
        ("OpenOptions", "re-exported from `options`, for tests"),
        ("DeviceSpec", "re-exported from `options`, for tests"),
        ("Layout", "re-exported from `redundancy`, for tests"),
        ("test_pool", "a one-device pool for unit tests (`facade`)"),
        (
            "test_volume",
            "a plain volume's options for unit tests (`facade`)",
        ),
    ],
    layers: &[
        // What the pool keeps, as bytes and files: labels, the table, the anchor, pool.json.
        ("format", &[]),
        // The object tier (a pool's copy in a bucket): its objects and the uploader.
        ("tier", &["format"]),
        // What `Pool::create` and `Pool::open` take, and what `status` returns.
        ("options", &["tier"]),
        ("status", &["format", "tier"]),
        // The intent log's blocks, chain and devices.
        ("intentlog", &["format", "status"]),
        // Group commit: which commit covers a FLUSH (model-checked: `crates/modelcheck`).
        ("group", &[]),
        // The cleaner's move against client writes: swap where the map still points at the
        // old copy, and set every snapshot and clone tree that still holds it
        // (model-checked: `crates/modelcheck`).
        ("relocate", &[]),
        // The state every volume handle shares.
        ("core", &["format", "group", "intentlog", "status", "tier"]),
        // Commit, the flush path, log-device administration.
        ("txg", &["core", "format", "intentlog"]),
        // Dataset operations on `Core`: snapshots and clones, properties, keys, rotation.
        ("snapshot", &["core"]),
        ("props", &["core"]),
        ("keys", &["core"]),
        ("rotate", &["core"]),
        // Upkeep: scrub and resilver, the cleaner, eviction to the object store.
        ("scrub", &["core", "format"]),
        ("clean", &["core", "relocate"]),
        // The cleaner's idle work: blocks rewritten in block order.
        ("defrag", &["core"]),
        ("evict", &["core", "tier"]),
        // Upkeep driven by its caller, one step at a time (the simulator's stepped mode).
        ("stepped", &["core", "scrub"]),
        // The pool's life: create, import (also crash recovery), the facade, and what runs
        // without a daemon (scan, export, destroy, upgrade).
        ("create", &["format", "intentlog", "options"]),
        (
            "import",
            &[
                "core",
                "evict",
                "format",
                "intentlog",
                "options",
                "scrub",
                "tier",
            ],
        ),
        (
            "facade",
            &[
                "core", "create", "format", "import", "keys", "options", "props", "scrub",
                "snapshot", "status",
            ],
        ),
        (
            "lifecycle",
            &["facade", "format", "import", "intentlog", "options"],
        ),
        // Tests that span rooms: an attacker's edits to the devices.
        ("hostile", &["create", "format", "lifecycle", "txg"]),
    ],
};

/// `pool/format/`: the on-disk and in-directory formats, each file one thing.
const POOL_FORMAT: Table = Table {
    src: "../engine/src/pool/format",
    root: "mod",
    within: &["pool", "format"],
    tests_only: &[],
    root_items: &[],
    layers: &[
        ("superblock", &[]),
        ("health", &[]),
        ("labels", &["superblock"]),
        ("config", &["labels", "superblock"]),
        ("anchor", &["config", "superblock"]),
        ("table", &["health"]),
    ],
};

/// `pool/intentlog/`: the block format and chain below the devices that hold them.
const POOL_INTENTLOG: Table = Table {
    src: "../engine/src/pool/intentlog",
    root: "mod",
    within: &["pool", "intentlog"],
    tests_only: &[],
    root_items: &[],
    layers: &[("block", &[]), ("devices", &["block"])],
};

/// Crates under `crates/` without a table yet, each with why. Every other
/// crate must have one (`every_crate_has_a_table`), so none is left out
/// unnoticed.
const NOT_YET_TABLED: &[(&str, &str)] = &[
    (
        "objstore",
        "one file (lib.rs): the S3 client behind the engine's tier::ObjectStore, no modules to order",
    ),
    (
        "modelcheck",
        "no modules of its own to order: `sync` (shuttle's primitives) and the engine's own \
         files (`constants`, `error`, `log`, `store/gate.rs`, `pool/group.rs`, `pool/relocate.rs`, `volume/uses.rs`, `volume/stripes.rs`) included by #[path], whose \
         order the engine's table keeps",
    ),
];

#[test]
fn engine_modules_keep_their_layers() {
    check(&ENGINE);
}

#[test]
fn pool_rooms_keep_their_layers() {
    check(&POOL);
    check(&POOL_FORMAT);
    check(&POOL_INTENTLOG);
}

#[test]
fn nbd_modules_keep_their_layers() {
    check(&NBD);
}

#[test]
fn bulwark_modules_keep_their_layers() {
    check(&BULWARK);
}

#[test]
fn csi_modules_keep_their_layers() {
    check(&CSI);
}

#[test]
fn sim_modules_keep_their_layers() {
    check(&SIM);
}

#[test]
fn every_crate_has_a_table() {
    let tabled = ["nbd", "bulwark", "engine", "csi", "sim"];
    let crates = manifest_dir().join("..");
    let mut missing = Vec::new();
    for entry in fs::read_dir(&crates).expect("read crates/") {
        let entry = entry.expect("read crates/");
        let name = entry.file_name().to_string_lossy().into_owned();
        if !entry.path().join("Cargo.toml").is_file() {
            continue;
        }
        if !tabled.contains(&name.as_str()) && !NOT_YET_TABLED.iter().any(|(n, _)| *n == name) {
            missing.push(name);
        }
    }
    assert!(
        missing.is_empty(),
        "crates without a layer table in {}: {missing:?}",
        file!()
    );
}

/// No circle of imports in any folder of any crate, tabled or not: inside every folder,
/// the files and sub-folders that use each other form a DAG. (A table fixes the order
/// too; this catches a circle where no table is drawn yet.)
#[test]
fn no_folder_holds_a_circle() {
    let crates = manifest_dir().join("..");
    let mut circles = Vec::new();
    for entry in fs::read_dir(&crates).expect("read crates/") {
        let src = entry.expect("read crates/").path().join("src");
        if src.is_dir() {
            folder_circles(&src, &src, &mut circles);
        }
    }
    assert!(
        circles.is_empty(),
        "import circles ({}):\n  {}",
        file!(),
        circles.join("\n  ")
    );
}

/// Circles among the children of `dir` (and, recursively, of its sub-folders).
fn folder_circles(src: &Path, dir: &Path, circles: &mut Vec<String>) {
    let within: Vec<String> = dir
        .strip_prefix(src)
        .expect("folder under src")
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let within: Vec<&str> = within.iter().map(String::as_str).collect();
    let root = if within.is_empty() {
        if dir.join("lib.rs").exists() {
            "lib"
        } else {
            "main"
        }
    } else {
        "mod"
    };
    let children = top_level_modules(dir, root);
    let mut edges: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for (child, files) in &children {
        for file in files {
            let text = fs::read_to_string(file)
                .unwrap_or_else(|e| panic!("cannot read {}: {e}", file.display()));
            for r in references(&text, depth_of(dir, file), &within) {
                if let Some((used, _)) = children.get_key_value(&r.name) {
                    if used != child {
                        edges.entry(child).or_default().insert(used);
                    }
                }
            }
        }
    }
    // Depth-first search; a node met again while still on the path closes a circle.
    fn visit<'a>(
        node: &'a str,
        edges: &BTreeMap<&'a str, BTreeSet<&'a str>>,
        path: &mut Vec<&'a str>,
        done: &mut BTreeSet<&'a str>,
        found: &mut Option<Vec<&'a str>>,
    ) {
        if found.is_some() || done.contains(node) {
            return;
        }
        if let Some(at) = path.iter().position(|n| *n == node) {
            let mut circle = path[at..].to_vec();
            circle.push(node);
            *found = Some(circle);
            return;
        }
        path.push(node);
        for next in edges.get(node).into_iter().flatten() {
            visit(next, edges, path, done, found);
        }
        path.pop();
        done.insert(node);
    }
    let mut done = BTreeSet::new();
    for child in children.keys() {
        let mut found = None;
        visit(child, &edges, &mut Vec::new(), &mut done, &mut found);
        if let Some(circle) = found {
            circles.push(format!("{}: {}", shown(dir), circle.join(" -> ")));
            break;
        }
    }
    for entry in fs::read_dir(dir).unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
    {
        let path = entry.expect("read source folder").path();
        if path.is_dir() {
            folder_circles(src, &path, circles);
        }
    }
}

/// The longest a function may be, in lines from `fn` to its closing brace, outside tests.
const FN_LINES_MAX: usize = 100;

/// Functions longer than `FN_LINES_MAX` on the day the check came (issue 38), each with its
/// length then. The list may only shrink: a listed function may not grow past its length,
/// and one that is cut to size (or gone) must leave the list.
const LONG_FUNCTIONS: &[(&str, &str, usize)] = &[
    ("crates/bulwark/src/daemon.rs", "handle", 270),
    ("crates/bulwark/src/daemon.rs", "serve_pool", 196),
    ("crates/bulwark/src/display.rs", "status_text", 160),
    ("crates/bulwark/src/grant.rs", "of", 122),
    ("crates/bulwark/src/image.rs", "export", 104),
    ("crates/bulwark/src/metrics/pool.rs", "encode_status", 481),
    ("crates/bulwark/src/pools.rs", "create", 169),
    ("crates/bulwark/src/pools.rs", "import", 125),
    ("crates/bulwark/src/pools.rs", "object_store", 178),
    ("crates/bulwark/src/volume.rs", "rows", 102),
    ("crates/csi/src/controller.rs", "create_volume", 196),
    ("crates/csi/src/node.rs", "stage", 123),
    ("crates/engine/src/pool/clean.rs", "move_records", 133),
    ("crates/engine/src/pool/core.rs", "device_replace", 108),
    ("crates/engine/src/pool/create.rs", "create_in", 263),
    ("crates/engine/src/pool/format/superblock.rs", "decode", 210),
    ("crates/engine/src/pool/import/build.rs", "build", 194),
    (
        "crates/engine/src/pool/import/devices.rs",
        "read_labels",
        165,
    ),
    (
        "crates/engine/src/pool/import/devices.rs",
        "take_members",
        217,
    ),
    ("crates/engine/src/pool/import/recount.rs", "recount", 238),
    ("crates/engine/src/pool/import/replay.rs", "replay", 415),
    ("crates/engine/src/pool/lifecycle.rs", "destroy", 138),
    ("crates/engine/src/pool/lifecycle.rs", "import_into", 276),
    ("crates/engine/src/pool/scrub.rs", "scrub_run", 194),
    ("crates/engine/src/pool/snapshot.rs", "volume_clone", 132),
    ("crates/engine/src/pool/tier/mod.rs", "publish_runs", 254),
    ("crates/engine/src/pool/tier/restore.rs", "restore", 210),
    ("crates/engine/src/pool/txg/commit.rs", "commit_locked", 315),
    (
        "crates/engine/src/pool/txg/intent.rs",
        "log_flush_held",
        116,
    ),
    (
        "crates/engine/src/pool/txg/logdev.rs",
        "set_log_devices",
        172,
    ),
    (
        "crates/engine/src/volume/mod.rs",
        "write_blocks_encoded",
        162,
    ),
    ("crates/nbd/src/server.rs", "negotiate_and_serve", 127),
];

/// Every function outside tests is at most `FN_LINES_MAX` lines, or on `LONG_FUNCTIONS`
/// at no more than its length there.
#[test]
fn functions_stay_short() {
    let crates = manifest_dir().join("..");
    let mut found: BTreeMap<(String, String), usize> = BTreeMap::new();
    for entry in fs::read_dir(&crates).expect("read crates/") {
        let src = entry.expect("read crates/").path().join("src");
        if !src.is_dir() {
            continue;
        }
        let mut files = Vec::new();
        rust_files(&src, &mut files);
        for file in files {
            let text = fs::read_to_string(&file)
                .unwrap_or_else(|e| panic!("cannot read {}: {e}", file.display()));
            for (name, lines) in function_lengths(&text) {
                if lines > FN_LINES_MAX {
                    let key = (shown(&file), name);
                    let longest = found.entry(key).or_default();
                    *longest = (*longest).max(lines);
                }
            }
        }
    }
    let mut problems = Vec::new();
    for ((file, name), lines) in &found {
        match LONG_FUNCTIONS
            .iter()
            .find(|(f, n, _)| f == file && n == name)
        {
            None => problems.push(format!(
                "{file}: fn {name} is {lines} lines (at most {FN_LINES_MAX}): split it into steps"
            )),
            Some((_, _, listed)) if lines > listed => problems.push(format!(
                "{file}: fn {name} grew to {lines} lines; LONG_FUNCTIONS allows it {listed} and \
                 may only shrink: split it"
            )),
            Some(_) => {}
        }
    }
    for (file, name, listed) in LONG_FUNCTIONS {
        if !found.contains_key(&(file.to_string(), name.to_string())) {
            problems.push(format!(
                "{file}: fn {name} (listed at {listed} lines) is now at most {FN_LINES_MAX} \
                 lines or gone: take it off LONG_FUNCTIONS"
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "function lengths ({}):\n  {}",
        file!(),
        problems.join("\n  ")
    );
}

/// What the engine may not reach for itself (issue 37): the clock, sleeping and
/// randomness come through `env.rs`, which a simulator replaces with seeded ones.
const ENVIRONMENT_CALLS: &[&str] = &[
    "Instant::now",
    "SystemTime::now",
    ".elapsed()",
    "thread::sleep",
    "rand::fill",
    "OsRng",
    "thread_rng",
];

#[test]
fn the_environment_comes_through_env() {
    let src = manifest_dir().join("../engine/src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut problems = Vec::new();
    for file in files {
        let name = file.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if file == src.join("env.rs")
            || name == "tests.rs"
            || name.ends_with("_tests.rs")
            || declared_for_tests(&file)
        {
            continue;
        }
        let text = fs::read_to_string(&file)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", file.display()));
        let code = code_only(&text);
        let tests = test_ranges(&code);
        for call in ENVIRONMENT_CALLS {
            for (at, _) in code.match_indices(call) {
                if !tests.iter().any(|(s, e)| (*s..*e).contains(&at)) {
                    problems.push(format!(
                        "{}:{}: {call}: use crate::env (now, since, sleep, fill, random)",
                        shown(&file),
                        line_of(&code, at)
                    ));
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Types whose state stays behind methods (issue 38): callers ask, they do not reach in.
/// Each is the file that defines it and the struct's name; a `pub` field (of any
/// visibility that reaches past the file's module: `pub`, `pub(crate)`, `pub(in …)`)
/// fails. `pub(super)` is allowed where a sibling file needs a field.
const PRIVATE_STATE: &[(&str, &str)] = &[
    ("crates/engine/src/store/mod.rs", "Store"),
    ("crates/engine/src/volume/mod.rs", "VolumeState"),
    // The control plane's state: `pub(super)` from pool/core.rs reaches the pool's own
    // rooms (pool/ and its folders), which implement `Core`; the rest of the engine asks
    // through `Pool` and `store::Control`.
    ("crates/engine/src/pool/core.rs", "Core"),
];

#[test]
fn private_state_stays_private() {
    let crates = manifest_dir().join("..");
    let mut problems = Vec::new();
    for (file, name) in PRIVATE_STATE {
        let path = crates.join(file.trim_start_matches("crates/"));
        let text = fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
        let Some(fields) = visible_fields(&text, name) else {
            problems.push(format!("{file}: no `pub struct {name} {{` found"));
            continue;
        };
        for (line, field) in fields {
            problems.push(format!(
                "{file}:{line}: `{name}` has a visible field `{field}`: keep it private and \
                 give callers a method named for what they want"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The fields of `pub struct name { … }` in `text` that are visible past their module
/// (`pub` other than `pub(super)`), each with its line; `None` when there is no such struct.
fn visible_fields(text: &str, name: &str) -> Option<Vec<(usize, String)>> {
    let code = code_only(text);
    let b = code.as_bytes();
    let head = format!("pub struct {name} {{");
    let start = code.find(&head)?;
    let open = start + head.len() - 1;
    let close = matching_brace(b, open);
    let mut out = Vec::new();
    let mut depth = 0;
    let mut at = open + 1;
    for line in code[open + 1..close].split_inclusive('\n') {
        let field = line.trim_start();
        if depth == 0 && field.starts_with("pub") && !field.starts_with("pub(super)") {
            let rest = field.trim_start_matches("pub").trim_start();
            let rest = match rest.strip_prefix('(') {
                Some(r) => r.split_once(')').map_or("", |(_, r)| r).trim_start(),
                None => rest,
            };
            let ident = leading_ident(rest).unwrap_or_default();
            out.push((line_of(&code, at), ident));
        }
        for c in line.bytes() {
            match c {
                b'{' | b'(' | b'[' => depth += 1,
                b'}' | b')' | b']' => depth -= 1,
                _ => {}
            }
        }
        at += line.len();
    }
    Some(out)
}

/// The field reader itself.
#[test]
fn visible_fields_are_found() {
    let text =
        "/// `pub` in a comment\npub struct S {\n    a: u8,\n    pub b: Vec<(u8, u8)>,\n    \
                pub(crate) c: u8,\n    pub(super) d: u8,\n    e: std::sync::Mutex<Option<u8>>,\n}\n\
                pub struct T { pub x: u8 }\n";
    let found = visible_fields(text, "S").expect("S is there");
    assert_eq!(found, vec![(4, "b".to_string()), (5, "c".to_string())]);
    assert!(visible_fields(text, "U").is_none());
}

/// Each function with a body outside test code: its name and its lines from `fn` to the
/// closing brace.
fn function_lengths(text: &str) -> Vec<(String, usize)> {
    let code = code_only(text);
    let b = code.as_bytes();
    let mut out = Vec::new();
    let test_ranges = test_ranges(&code);
    let mut i = 0;
    while let Some(at) = code[i..].find("fn ") {
        let start = i + at;
        i = start + 3;
        if start > 0 && is_ident(b[start - 1]) {
            continue;
        }
        if test_ranges.iter().any(|(s, e)| (*s..*e).contains(&start)) {
            continue;
        }
        let Some(name) = leading_ident(&code[start + 3..]) else {
            continue;
        };
        // The body opens at the first `{` after the signature; a `;` first means none.
        let Some(p) = code[start..].find(['{', ';']) else {
            continue;
        };
        let open = start + p;
        if b[open] == b';' {
            continue;
        }
        let close = matching_brace(b, open);
        out.push((name, line_of(&code, close) - line_of(&code, start) + 1));
    }
    out
}

/// Byte ranges of test code in `code` (from `code_only`): the items marked `#[cfg(test)]`.
fn test_ranges(code: &str) -> Vec<(usize, usize)> {
    let b = code.as_bytes();
    let mut ranges = Vec::new();
    let mut from = 0;
    while let Some(at) = code[from..].find("#[cfg(test)]") {
        let start = from + at;
        let open = code[start..].find(['{', ';']).map(|p| start + p);
        match open {
            Some(o) if b[o] == b'{' => {
                let end = matching_brace(b, o);
                ranges.push((start, end));
                from = end;
            }
            Some(o) => from = o + 1,
            None => break,
        }
    }
    ranges
}

/// The index of the `}` that closes the `{` at `open`.
fn matching_brace(b: &[u8], open: usize) -> usize {
    let mut depth = 0;
    for (j, c) in b.iter().enumerate().skip(open) {
        match c {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return j;
                }
            }
            _ => {}
        }
    }
    b.len().saturating_sub(1)
}

/// The extractor itself, on text that holds every form it must read and
/// some it must not.
#[test]
fn references_are_read_from_code_only() {
    let text = r##"
//! crate::doc_comment is prose
use crate::a::{self, X};
use crate::{b, c::{D, E as F}};
use super::g; // in a top-level file, super is the crate root
/* crate::block_comment */
fn f() -> crate::h::T {
    let s = "crate::in_a_string";
    let r = r#"crate::in_a_raw_string"#;
    let c = '"'; let _: &'static str = "x";
    crate::i::call();
    $crate::j::k!();
}
pub(crate) fn visible() {}
#[cfg(test)]
mod tests {
    use super::*;
    use super::super::l;
    mod deeper { use super::super::super::m; }
}
"##;
    let found: Vec<String> = references(text, 1, &[])
        .into_iter()
        .map(|r| r.name)
        .collect();
    assert_eq!(found, ["a", "b", "c", "g", "h", "i", "j", "l", "m"]);
}

// ---------------------------------------------------------------------------

fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A path as the workspace names it (`crates/nbd/src/server.rs`).
fn shown(path: &Path) -> String {
    let workspace = manifest_dir().join("../..");
    match (fs::canonicalize(path), fs::canonicalize(workspace)) {
        (Ok(p), Ok(w)) => p.strip_prefix(&w).unwrap_or(&p).display().to_string(),
        _ => path.display().to_string(),
    }
}

fn check(table: &Table) {
    let src = manifest_dir().join(table.src);
    let modules = top_level_modules(&src, table.root);
    let mut problems = Vec::new();

    // The table itself: bottom-up, each module once, using only modules above it.
    let mut above: BTreeSet<&str> = BTreeSet::new();
    for (module, uses) in table.layers {
        if !above.insert(module) {
            problems.push(format!("`{module}` has two rows"));
        }
        for used in *uses {
            let item = table.root_items.iter().any(|(n, _)| n == used);
            if !item && (!above.contains(used) || used == module) {
                problems.push(format!(
                    "`{module}` may use `{used}`, which is not a row above it: \
                     rows must be bottom-up, so that no circle can be allowed"
                ));
            }
        }
    }
    let tabled: BTreeSet<&str> = table.layers.iter().map(|(m, _)| *m).collect();
    for module in modules.keys() {
        if !tabled.contains(module.as_str()) {
            problems.push(format!(
                "module `{module}` ({}) has no row in the table: add it where it belongs",
                shown(&modules[module][0])
            ));
        }
    }
    for module in &tabled {
        if !modules.contains_key(*module) {
            problems.push(format!(
                "the table has a row for `{module}`, but {} has no such module",
                shown(&src)
            ));
        }
    }

    // The code against the table.
    let root_file = src.join(format!("{}.rs", table.root));
    let root_text = fs::read_to_string(&root_file)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", root_file.display()));
    // Modules the root declares only for tests (`#[cfg(test)] mod x;`): all their code is test code.
    let test_modules: BTreeSet<String> = code_only(&root_text)
        .split("#[cfg(test)]")
        .skip(1)
        .filter_map(|after| {
            let after = after.trim_start();
            let name = after.strip_prefix("mod ")?.trim_start();
            let end = name.find(|c: char| !is_ident(c as u8))?;
            name[end..]
                .trim_start()
                .starts_with(';')
                .then(|| name[..end].to_string())
        })
        .collect();
    let mut used_by: BTreeMap<&str, BTreeSet<String>> = BTreeMap::new();
    for (module, uses) in table.layers {
        let Some(files) = modules.get(*module) else {
            continue;
        };
        for file in files {
            let text = fs::read_to_string(file)
                .unwrap_or_else(|e| panic!("cannot read {}: {e}", file.display()));
            for Ref {
                line,
                name,
                in_test,
            } in references(&text, depth_of(&src, file), table.within)
            {
                let at = format!("{}:{line}", shown(file));
                let in_test = in_test || test_modules.contains(*module) || declared_for_tests(file);
                if table.tests_only.contains(&name.as_str()) && !in_test {
                    problems.push(format!(
                        "{at}: `{module}` uses `{name}` outside test code: it is the facade's \
                         re-export, for tests only; use the room that defines it"
                    ));
                }
                // Root items are for every module (each row says why it is one).
                if name == *module || table.root_items.iter().any(|(n, _)| *n == name) {
                    continue;
                }
                if !tabled.contains(name.as_str())
                    && !table.root_items.iter().any(|(n, _)| *n == name)
                {
                    problems.push(format!(
                        "{at}: `{module}` uses `crate::{name}`, which is no module in the table \
                         nor a root item it allows"
                    ));
                } else if !uses.contains(&name.as_str()) {
                    problems.push(format!(
                        "{at}: `{module}` uses `{name}`, which its row does not allow \
                         (it may use {uses:?}); move what it needs below it, or change \
                         the table if the new edge is meant"
                    ));
                }
                used_by.entry(module).or_default().insert(name);
            }
        }
        for allowed in *uses {
            if !used_by.get(module).is_some_and(|u| u.contains(*allowed)) {
                problems.push(format!(
                    "`{module}` may use `{allowed}` but does not: take it out of its row"
                ));
            }
        }
    }
    // The root declares the modules; what else it uses must still be a module or a root item.
    for Ref { line, name, .. } in references(&root_text, 0, table.within) {
        if !tabled.contains(name.as_str()) && !table.root_items.iter().any(|(n, _)| *n == name) {
            problems.push(format!(
                "{}:{line}: the crate root uses `crate::{name}`, which is no module in the table",
                shown(&root_file)
            ));
        }
    }

    assert!(
        problems.is_empty(),
        "the modules of {} break their layers ({}):\n  {}",
        shown(&src),
        file!(),
        problems.join("\n  ")
    );
}

/// Whether `file` is a module its parent declares only for tests (`#[cfg(test)] mod x;`
/// in the `mod.rs` beside it).
fn declared_for_tests(file: &Path) -> bool {
    let (Some(stem), Some(dir)) = (file.file_stem(), file.parent()) else {
        return false;
    };
    let Ok(parent) = fs::read_to_string(dir.join("mod.rs")) else {
        return false;
    };
    let want = format!("mod {};", stem.to_string_lossy());
    code_only(&parent)
        .split("#[cfg(test)]")
        .skip(1)
        .any(|after| after.trim_start().starts_with(&want))
}

/// Top-level modules of the crate in `src`: `x.rs` and the folder `x/`, each
/// with every `.rs` file under it; the crate root itself is left out.
fn top_level_modules(src: &Path, root: &str) -> BTreeMap<String, Vec<PathBuf>> {
    let mut modules: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    for entry in fs::read_dir(src).unwrap_or_else(|e| panic!("cannot read {}: {e}", src.display()))
    {
        let path = entry.expect("read source folder").path();
        if path.is_dir() {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let files = modules.entry(name).or_default();
            rust_files(&path, files);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let name = path.file_stem().unwrap().to_string_lossy().into_owned();
            if name != root {
                modules.entry(name).or_default().push(path);
            }
        }
    }
    for files in modules.values_mut() {
        files.sort();
    }
    modules
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
    {
        let path = entry.expect("read source folder").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// How deep below the crate root the file's own module is: `src/x.rs` and
/// `src/x/mod.rs` are 1, `src/x/y.rs` is 2.
fn depth_of(src: &Path, file: &Path) -> usize {
    let rel = file.strip_prefix(src).expect("file under src");
    let parts = rel.components().count();
    if rel.file_name().is_some_and(|n| n == "mod.rs") {
        parts - 1
    } else {
        parts
    }
}

/// A name a file's code uses, with the line it is on and whether that line is test code
/// (inside an item marked `#[cfg(test)]`).
struct Ref {
    line: usize,
    name: String,
    in_test: bool,
}

/// The modules a file's code names at the level of the table it is checked against:
/// for a crate (`within` empty), `crate::X` (and `$crate::X`), `use crate::{X, …}`, and
/// `super` chains that climb to the crate root; for a folder inside a crate (`within` =
/// its module path), `crate::<within>::X` and `super` chains that climb exactly to the
/// folder (uses that leave the folder are the crate table's to check). `depth` is the
/// file's own module depth below the table's folder (`depth_of`); inline `mod x { … }`
/// blocks add to it.
fn references(text: &str, depth: usize, within: &[&str]) -> Vec<Ref> {
    let code = code_only(text);
    let bytes = code.as_bytes();
    let mut out = Vec::new();
    // Open braces: whether each opened an inline module, and whether it is test code.
    let mut braces: Vec<(bool, bool)> = Vec::new();
    let mut pending_mod = false;
    let mut pending_test = false;
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        let in_test = pending_test || braces.iter().any(|b| b.1);
        if c == b'{' {
            braces.push((pending_mod, in_test));
            pending_mod = false;
            pending_test = false;
            i += 1;
            continue;
        }
        if c == b'}' {
            braces.pop();
            i += 1;
            continue;
        }
        if c == b';' {
            pending_mod = false;
            pending_test = false;
        }
        if code[i..].starts_with("#[cfg(test)]") {
            pending_test = true;
            i += "#[cfg(test)]".len();
            continue;
        }
        if !is_ident(c) || (i > 0 && is_ident(bytes[i - 1])) {
            i += 1;
            continue;
        }
        let word_end = (i..bytes.len())
            .find(|&j| !is_ident(bytes[j]))
            .unwrap_or(bytes.len());
        let word = &code[i..word_end];
        let mut found = |at: usize, rest: &str| {
            let line = line_of(&code, at);
            for name in first_segments(rest) {
                out.push(Ref {
                    line,
                    name,
                    in_test,
                });
            }
        };
        match word {
            "mod" => pending_mod = true,
            "crate" if code[word_end..].starts_with("::") => {
                let mut rest = word_end + 2;
                let mut inside = true;
                for seg in within {
                    let want = format!("{seg}::");
                    if code[rest..].trim_start().starts_with(&want) {
                        rest = rest
                            + (code[rest..].len() - code[rest..].trim_start().len())
                            + want.len();
                    } else {
                        inside = false;
                        break;
                    }
                }
                if inside {
                    found(i, &code[rest..]);
                }
            }
            "super" if code[word_end..].starts_with("::") => {
                // Count the chain; it names the table's level when it climbs as high as we
                // are deep (for a crate: at least as high).
                let here = depth + braces.iter().filter(|m| m.0).count();
                let mut supers = 1;
                let mut rest = word_end + 2;
                while code[rest..].starts_with("super::") {
                    supers += 1;
                    rest += "super::".len();
                }
                let names_level = if within.is_empty() {
                    supers >= here
                } else {
                    supers == here
                };
                if names_level {
                    found(i, &code[rest..]);
                }
                i = rest;
                continue;
            }
            _ => {}
        }
        i = word_end;
    }
    out
}

/// The first path segment after `crate::`: one name, or each item of a `{…}` group.
fn first_segments(after: &str) -> Vec<String> {
    let after = after.trim_start();
    if let Some(group) = after.strip_prefix('{') {
        let mut names = Vec::new();
        let mut depth = 0;
        let mut item = String::new();
        for c in group.chars() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => break,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    names.extend(leading_ident(&item));
                    item.clear();
                    continue;
                }
                _ => {}
            }
            if depth == 0 {
                item.push(c);
            }
        }
        names.extend(leading_ident(&item));
        names.retain(|n| n != "self");
        names
    } else {
        leading_ident(after).into_iter().collect()
    }
}

fn leading_ident(s: &str) -> Option<String> {
    let s = s.trim_start();
    let end = s.find(|c: char| !is_ident(c as u8)).unwrap_or(s.len());
    (end > 0).then(|| s[..end].to_string())
}

fn is_ident(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

fn line_of(code: &str, at: usize) -> usize {
    code[..at].bytes().filter(|b| *b == b'\n').count() + 1
}

/// The text with comments, string and char literals blanked out (newlines
/// kept, so line numbers stay right).
fn code_only(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let rest = &b[i..];
        let after_ident = i > 0 && is_ident(b[i - 1]);
        let literal = if rest.starts_with(b"//") {
            Some(rest.iter().position(|c| *c == b'\n').unwrap_or(rest.len()))
        } else if rest.starts_with(b"/*") {
            Some(block_comment_len(rest))
        } else if rest[0] == b'"' {
            let mut j = 1;
            while j < rest.len() && rest[j] != b'"' {
                j += if rest[j] == b'\\' { 2 } else { 1 };
            }
            Some((j + 1).min(rest.len()))
        } else if rest[0] == b'\'' {
            char_literal_len(&text[i..])
        } else if after_ident {
            None
        } else {
            raw_string_len(rest)
        };
        match literal {
            Some(len) => {
                out.extend(
                    rest[..len]
                        .iter()
                        .map(|c| if *c == b'\n' { b'\n' } else { b' ' }),
                );
                i += len;
            }
            None => {
                out.push(rest[0]);
                i += 1;
            }
        }
    }
    String::from_utf8(out).expect("blanking keeps UTF-8 whole")
}

/// Length of a block comment at the start of `s` (they nest in Rust).
fn block_comment_len(s: &[u8]) -> usize {
    let (mut depth, mut j) = (0usize, 0);
    while j < s.len() {
        if s[j..].starts_with(b"/*") {
            depth += 1;
            j += 2;
        } else if s[j..].starts_with(b"*/") {
            depth -= 1;
            j += 2;
            if depth == 0 {
                break;
            }
        } else {
            j += 1;
        }
    }
    j
}

/// Length of a char literal (`'x'`, `'\n'`, `'\u{..}'`) at the start of `s`,
/// or `None` for a lifetime (`'a`).
fn char_literal_len(s: &str) -> Option<usize> {
    let b = s.as_bytes();
    if b.get(1) == Some(&b'\\') {
        return b.get(3..)?.iter().position(|c| *c == b'\'').map(|p| p + 4);
    }
    let c = s[1..].chars().next()?;
    let end = 1 + c.len_utf8();
    (b.get(end) == Some(&b'\'')).then_some(end + 1)
}

/// Length of a raw string literal (`r"…"`, `r#"…"#`, `br#"…"#`) at the start of `s`.
fn raw_string_len(s: &[u8]) -> Option<usize> {
    let start = if s.starts_with(b"br") {
        2
    } else if s.starts_with(b"r") {
        1
    } else {
        return None;
    };
    let hashes = s[start..].iter().take_while(|c| **c == b'#').count();
    if s.get(start + hashes) != Some(&b'"') {
        return None;
    }
    let mut close = vec![b'"'];
    close.extend(std::iter::repeat_n(b'#', hashes));
    let body = start + hashes + 1;
    s[body..]
        .windows(close.len())
        .position(|w| w == close.as_slice())
        .map(|p| body + p + close.len())
}
