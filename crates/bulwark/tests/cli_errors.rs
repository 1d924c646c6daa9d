//! What a user sees when a command cannot run: one `error:` line, exit 1, or
//! 2 for usage mistakes. None of these need a pool or a daemon.

use std::process::{Command, Output};

fn bulwark(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_bulwark"))
        .args(args)
        // The pools these tests create go in a registry of their own, not this host's.
        .env(
            "BULWARK_REGISTRY",
            concat!(env!("CARGO_TARGET_TMPDIR"), "/cli-errors-registry.json"),
        )
        .env_remove("BULWARK_POOL")
        .env("BULWARK_LOG", "error")
        .output()
        .expect("run bulwark")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn no_pool_given() {
    for args in [
        &["status"][..],
        &["volume", "list"],
        &["key", "unload", "v"],
        &["serve"],
    ] {
        let o = bulwark(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        assert_eq!(
            stderr(&o),
            "error: no pool given: use --pool DIR or set BULWARK_POOL\n",
            "{args:?}"
        );
    }
}

#[test]
fn daemon_not_running() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    // An empty directory is no pool, and says so.
    let o = bulwark(&["--pool", d, "status"]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        stderr(&o),
        format!("error: no bulwark pool in {d} (create one with 'bulwark pool create {d} ...')\n")
    );
    let o = bulwark(&[
        "pool",
        "create",
        d,
        "--devices",
        "1",
        "--device-size",
        "64M",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    // A pool whose daemon is not running.
    let o = bulwark(&["--pool", d, "status"]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(stderr(&o), format!("error: cannot reach the bulwark daemon for pool {d} (is 'bulwark serve {d}' running?)\n"));

    // The environment variable works as well as the flag.
    let o = Command::new(env!("CARGO_BIN_EXE_bulwark"))
        .args(["volume", "list", "--json"])
        .env("BULWARK_POOL", d)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("cannot reach the bulwark daemon"),
        "{}",
        stderr(&o)
    );

    // A stale socket file (no listener behind it) reads the same.
    let stale = std::os::unix::net::UnixListener::bind(dir.path().join("control.sock")).unwrap();
    drop(stale);
    let o = bulwark(&["--pool", d, "status"]);
    assert!(
        stderr(&o).contains("cannot reach the bulwark daemon"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn encryption_and_keys_must_agree() {
    let o = bulwark(&[
        "--pool",
        "/nonexistent",
        "volume",
        "create",
        "v",
        "--size",
        "1G",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("needs --passphrase-file PATH or --key-file PATH"),
        "{}",
        stderr(&o)
    );

    let o = bulwark(&[
        "--pool",
        "/nonexistent",
        "volume",
        "create",
        "v",
        "--size",
        "1G",
        "--encryption",
        "off",
        "--key-file",
        "/k",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("--key-file was given with --encryption off"),
        "{}",
        stderr(&o)
    );

    let o = bulwark(&[
        "--pool",
        "/nonexistent",
        "volume",
        "create",
        "v",
        "--size",
        "1G",
        "--key-file",
        "/nonexistent/key",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).starts_with("error: cannot use key file /nonexistent/key:"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn bad_values_are_usage_errors() {
    for args in [
        &[
            "--pool",
            "/p",
            "volume",
            "create",
            "v",
            "--size",
            "1G",
            "--block-size",
            "6K",
            "--key-file",
            "/k",
        ][..],
        &[
            "--pool",
            "/p",
            "volume",
            "create",
            "v",
            "--size",
            "lots",
            "--key-file",
            "/k",
        ],
        &[
            "--pool",
            "/p",
            "volume",
            "create",
            "v",
            "--size",
            "1G",
            "--compression",
            "zstd",
            "--key-file",
            "/k",
        ],
        &[
            "pool",
            "create",
            "/p",
            "--layout",
            "mirror:9",
            "--device-size",
            "1G",
        ],
        &["pool", "create", "/p", "--layout", "single"],
        &["key", "load", "v"],
        &[
            "volume",
            "create",
            "v",
            "--size",
            "1G",
            "--passphrase-file",
            "/p",
            "--key-file",
            "/k",
        ],
    ] {
        let o = bulwark(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(
            stderr(&o).starts_with("error: "),
            "{args:?}: {}",
            stderr(&o)
        );
        assert_eq!(
            stderr(&o).lines().count(),
            1,
            "{args:?}: one line, no usage dump: {}",
            stderr(&o)
        );
    }
}

#[test]
fn serve_without_a_pool_directory() {
    let o = bulwark(&["serve", "/nonexistent/pool"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).starts_with("error: cannot open pool /nonexistent/pool:"),
        "{}",
        stderr(&o)
    );
}
