//! The object store, from the binary's side (issue 22, docs/object-store.md): building the
//! client a pool names (`bulwark-objstore`), the startup probe, the writer's name, and
//! `pool probe-store`. The engine does the rest (`pool::tier`).

use std::path::Path;
use std::sync::Arc;

use bulwark_engine::pool::format::config::ObjectStoreConfig;
use bulwark_engine::pool::tier::TierOpen;
use bulwark_engine::tier::ObjectStore;

use crate::cli::{ObjectStoreArgs, PoolProbeStoreArgs};
use crate::error::{Error, Result};

/// The client for `url` with the credentials file, if any.
pub fn open_store(
    url: &str,
    credentials: Option<&Path>,
) -> bulwark_engine::Result<Arc<dyn ObjectStore>> {
    let loc = bulwark_objstore::Location::parse(url)?;
    let s3 = bulwark_objstore::S3::open(&loc, credentials, bulwark_objstore::Deadlines::default())?;
    Ok(Arc::new(s3))
}

/// Set by `serve`: a pool whose every byte is local (no local cache size) starts while its
/// object store does not answer, and takes it once it does (docs/object-store.md). Other
/// commands (`pool import`, `export`, `object-store add`) still need the store.
pub static SERVE_WITHOUT_STORE: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// How the engine reaches the store a pool names (`tier::set_opener`, at start): the
/// client, probed. A directory copied or moved to another place or host is another
/// writer: the store's holder is then taken only with an export or `--force`.
pub fn opener(dir: &Path, os: &ObjectStoreConfig) -> bulwark_engine::Result<TierOpen> {
    let store = open_store(&os.url, os.credentials.as_deref())?;
    let defer =
        SERVE_WITHOUT_STORE.load(std::sync::atomic::Ordering::Acquire) && os.cache_bytes.is_none();
    match probe(&*store, os.single_host) {
        Ok(_) => {}
        // `serve` of a pool whose every byte is local: the store is taken (and probed)
        // once it answers (`Tier::attach_late`).
        Err(e @ bulwark_engine::Error::Io(_)) if defer => {
            tracing::warn!("the object store does not answer: {e}")
        }
        Err(e) => return Err(e),
    }
    let writer = if same_place(dir, &os.writer) {
        os.writer.clone()
    } else {
        tracing::warn!(
            "{} was made as '{}', on another host or in another directory: it takes the \
             pool only if that writer exported it",
            dir.display(),
            os.writer
        );
        format!("{} (a copy of {})", writer_name(dir), os.writer)
    };
    let mut open = tier_open(store, os, false, false);
    open.writer = writer;
    open.defer_unreachable = defer;
    Ok(open)
}

/// How a pool with `os` in its `pool.json` asks for its store: `create` a new pool there
/// (the store must hold none), `force` a takeover.
pub fn tier_open(
    store: Arc<dyn ObjectStore>,
    os: &ObjectStoreConfig,
    create: bool,
    force: bool,
) -> TierOpen {
    TierOpen {
        store,
        writer: os.writer.clone(),
        create,
        force,
        gc_grace: bulwark_engine::constants::TIER_GC_GRACE,
        local_flush: os.local_flush,
        cache_bytes: os.cache_bytes,
        defer_unreachable: false,
        single_host: os.single_host,
    }
}

/// Run the probe (`tier::probe`) on a fresh name; a store that fails it is refused unless
/// `single_host` (then warned about).
pub fn probe(
    store: &dyn ObjectStore,
    single_host: bool,
) -> bulwark_engine::Result<Vec<&'static str>> {
    let name = format!(
        "probe/{}",
        bulwark_engine::hex::to_hex(&bulwark_engine::keys::wrap::random_bytes::<8>())
    );
    match bulwark_engine::tier::probe(store, &name) {
        Ok(passed) => Ok(passed),
        Err(e @ bulwark_engine::Error::Invalid(_)) if single_host => {
            tracing::warn!(
                "{e}. Going on: --object-store-single-host was given; nothing fences a second \
                 host that takes this pool"
            );
            Ok(Vec::new())
        }
        Err(e) => Err(e),
    }
}

/// This host's name as the pool's writer: host name, pool directory, and a random tag (a
/// copy of the directory on another host is another writer: `same_place`).
pub fn writer_name(dir: &Path) -> String {
    format!(
        "{}:{}#{}",
        host_name(),
        dir.display(),
        bulwark_engine::hex::to_hex(&bulwark_engine::keys::wrap::random_bytes::<4>())
    )
}

/// Whether `writer` (`writer_name`) names this host and the directory `dir` is.
fn same_place(dir: &Path, writer: &str) -> bool {
    let Some((place, _tag)) = writer.rsplit_once('#') else {
        return false;
    };
    let Some((host, path)) = place.split_once(':') else {
        return false;
    };
    let canon = |p: &Path| std::fs::canonicalize(p).ok();
    host == host_name() && canon(Path::new(path)).is_some() && canon(Path::new(path)) == canon(dir)
}

fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0 {
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        String::from_utf8_lossy(&buf[..end]).into_owned()
    } else {
        "unknown-host".into()
    }
}

/// The configuration `pool create` and `pool import` write for `url`.
pub fn config(dir: &Path, url: &str, args: &ObjectStoreArgs) -> Result<ObjectStoreConfig> {
    let loc = bulwark_objstore::Location::parse(url)?;
    let credentials = match &args.object_store_credentials {
        Some(p) => Some(
            std::fs::canonicalize(p)
                .map_err(|e| Error::msg(format!("cannot read {}: {e}", p.display())))?,
        ),
        None => None,
    };
    Ok(ObjectStoreConfig {
        url: loc.to_string(),
        credentials,
        writer: writer_name(dir),
        single_host: args.object_store_single_host,
        local_flush: args.object_store_flush == crate::cli::FlushMode::Local,
        cache_bytes: args.object_store_cache_size,
    })
}

/// `bulwark pool probe-store URL`.
pub fn probe_store(args: &PoolProbeStoreArgs) -> Result<()> {
    let store = open_store(&args.url, args.store.object_store_credentials.as_deref())?;
    let passed = probe(&*store, false)?;
    if args.json {
        println!(
            "{}",
            serde_json::json!({ "store": store.describe(), "honours_conditions": true, "passed": passed })
        );
    } else {
        println!("{}: honours conditional writes", store.describe());
        for p in passed {
            println!("  ok  {p}");
        }
    }
    Ok(())
}
