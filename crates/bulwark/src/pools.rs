//! `bulwark pool create|list|status|export|import|destroy`, and the host's registry
//! of pools (what `pool list` lists and pool names resolve through).
//!
//! None of these needs a daemon: they run the engine's pool life cycle
//! (`bulwark_engine::pool::lifecycle`) directly, and refuse a pool a daemon serves
//! (one answers on its control socket; the engine's pool lock and device claims
//! refuse it too). `pool status` of a served pool is `bulwark status`.
//!
//! The registry is a small JSON file: `$BULWARK_REGISTRY`, else
//! `/etc/bulwark/pools.json` for root and `$XDG_CONFIG_HOME/bulwark/pools.json`
//! (`~/.config/...`) for other users. It maps names to directories; the state of
//! each pool is read live (its control socket, its `pool.json`). Entries whose
//! directory no longer holds the pool are stale: they are listed as `missing` and
//! dropped at the next change. Updates hold an flock on `FILE.lock` and replace the
//! file atomically; a registry that cannot be written is a warning, never a reason
//! to fail a command whose work is done.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bulwark_engine::pool::format::config::{default_pool_name, PoolConfig};
use bulwark_engine::pool::lifecycle::{self, FoundPool, ImportOptions};
use bulwark_engine::pool::OpenOptions;
use bulwark_engine::size::format_size;
use bulwark_engine::{DeviceSpec, Layout, Pool};
use serde::{Deserialize, Serialize};

use crate::access;
use crate::cli::{
    ListArgs, PoolCacheCommand, PoolCreateArgs, PoolDestroyArgs, PoolImportArgs, PoolLogCommand,
    PoolObjectStoreCommand, PoolStatusArgs, PoolTargetArgs, StatusArgs,
};
use crate::client::{self, print, print_json};
use crate::control::{self, Request, Response, StatusReport};
use crate::display::{Align, Table};
use crate::error::{Error, Result};

/// How long `pool list` and the served-pool checks wait for a daemon's answer.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

// ---- the registry --------------------------------------------------------------

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub name: String,
    pub dir: PathBuf,
    pub pool_id: String,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct RegistryFile {
    #[serde(default)]
    pools: Vec<Entry>,
}

/// Where this user's registry lives.
pub fn registry_path() -> PathBuf {
    if let Some(p) = std::env::var_os("BULWARK_REGISTRY").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return PathBuf::from("/etc/bulwark/pools.json");
    }
    let config = std::env::var_os("XDG_CONFIG_HOME")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")))
        .unwrap_or_else(|| PathBuf::from("."));
    config.join("bulwark").join("pools.json")
}

fn read_registry(path: &Path) -> Result<Vec<Entry>> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice::<RegistryFile>(&bytes)
            .map(|r| r.pools)
            .map_err(|e| Error::msg(format!("pool registry {}: {e}", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(Error::msg(format!(
            "cannot read the pool registry {}: {e}",
            path.display()
        ))),
    }
}

/// The pools registered on this host (an unreadable registry is empty, with a warning).
pub fn registered() -> Vec<Entry> {
    let path = registry_path();
    read_registry(&path).unwrap_or_else(|e| {
        eprintln!("warning: {e}");
        Vec::new()
    })
}

/// Whether `e` still names the pool it was registered for.
fn live(e: &Entry) -> bool {
    PoolConfig::read(&e.dir).is_ok_and(|c| c.pool_id == e.pool_id)
}

/// Change the registry under its lock; stale entries are dropped on the way.
fn update(change: impl FnOnce(&mut Vec<Entry>)) -> Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    use std::os::unix::io::AsRawFd;
    let path = registry_path();
    let parent = path.parent().unwrap_or(Path::new("."));
    let cannot = |what: &str, p: &Path, e: std::io::Error| {
        Error::msg(format!("cannot {what} {}: {e}", p.display()))
    };
    std::fs::create_dir_all(parent).map_err(|e| cannot("create", parent, e))?;
    let lock_path = path.with_extension("lock");
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(&lock_path)
        .map_err(|e| cannot("open", &lock_path, e))?;
    // SAFETY: flock on a descriptor we own; released when `lock` is closed.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(cannot("lock", &lock_path, std::io::Error::last_os_error()));
    }
    let mut pools = read_registry(&path)?;
    change(&mut pools);
    pools.retain(live);
    pools.sort_by(|a, b| a.name.cmp(&b.name).then(a.dir.cmp(&b.dir)));
    pools.dedup();
    let mut text = serde_json::to_vec_pretty(&RegistryFile { pools }).expect("serializes");
    text.push(b'\n');
    let tmp = path.with_extension("json.tmp");
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .mode(0o600)
            .open(&tmp)?;
        f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
        f.write_all(&text)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)
    };
    write().map_err(|e| cannot("write", &path, e))
}

/// `update`, a failure of which is only a warning: the command's work is done.
fn update_or_warn(change: impl FnOnce(&mut Vec<Entry>)) {
    if let Err(e) = update(change) {
        eprintln!("warning: the pool registry was not updated: {e}");
    }
}

/// Register pool `name` (id `pool_id`) in `dir`, replacing entries of the same pool.
fn register(name: &str, dir: &Path, pool_id: &str) {
    let entry = Entry {
        name: name.to_string(),
        dir: dir.to_path_buf(),
        pool_id: pool_id.to_string(),
    };
    update_or_warn(|pools| {
        pools.retain(|e| e.pool_id != entry.pool_id && e.dir != entry.dir);
        pools.push(entry);
    });
}

/// Refuses `name` when another live pool on this host has it.
fn check_name_free(name: &str, dir: &Path, pool_id: Option<&str>) -> Result<()> {
    let clash = registered()
        .into_iter()
        .find(|e| e.name == name && e.dir != dir && Some(e.pool_id.as_str()) != pool_id && live(e));
    match clash {
        Some(e) => Err(Error::msg(format!(
            "a pool named {name} is already registered on this host ({}): choose another \
             name with --name NAME",
            e.dir.display()
        ))),
        None => Ok(()),
    }
}

/// Absolute form of `dir` (its parent resolved, the directory itself need not exist).
fn absolute(dir: &Path) -> PathBuf {
    if let Ok(p) = std::fs::canonicalize(dir) {
        return p;
    }
    let abs = if dir.is_absolute() {
        dir.to_path_buf()
    } else {
        std::env::current_dir()
            .map(|c| c.join(dir))
            .unwrap_or(dir.to_path_buf())
    };
    match (abs.parent(), abs.file_name()) {
        (Some(parent), Some(name)) => std::fs::canonicalize(parent)
            .map(|p| p.join(name))
            .unwrap_or(abs),
        _ => abs,
    }
}

/// The directory `target` means: a path (it has a '/', or is a directory holding a
/// pool) as it is, else a name looked up in the registry.
pub fn resolve(target: &str) -> Result<PathBuf> {
    let as_path = Path::new(target);
    if target.contains('/') || as_path.join("pool.json").exists() {
        return Ok(absolute(as_path));
    }
    let matches: Vec<Entry> = registered()
        .into_iter()
        .filter(|e| e.name == target)
        .collect();
    match matches.len() {
        0 => Err(Error::msg(format!(
            "no pool named {target} is registered on this host ({}): give its directory, \
             or see 'bulwark pool list'",
            registry_path().display()
        ))),
        1 => Ok(matches[0].dir.clone()),
        _ => Err(Error::msg(format!(
            "{} pools named {target} are registered ({}): give the directory",
            matches.len(),
            matches
                .iter()
                .map(|e| e.dir.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

// ---- a daemon serving the pool -------------------------------------------------

/// What a daemon serving `dir` answers to `status`, if one does (within `PROBE_TIMEOUT`).
fn probe(dir: &Path) -> Probe {
    let path = control::control_socket_path(dir);
    let stream = match UnixStream::connect(&path) {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => return Probe::NoAccess,
        Err(_) => return Probe::None,
    };
    let ask = || -> std::io::Result<Option<StatusReport>> {
        stream.set_read_timeout(Some(PROBE_TIMEOUT))?;
        stream.set_write_timeout(Some(PROBE_TIMEOUT))?;
        let mut line = serde_json::to_string(&Request::Status).expect("serializes");
        line.push('\n');
        (&stream).write_all(line.as_bytes())?;
        let mut answer = String::new();
        BufReader::new(&stream).read_line(&mut answer)?;
        Ok(match Response::from_line(answer.trim_end()) {
            Ok(Response::Ok(v)) => serde_json::from_value(v).ok(),
            _ => None,
        })
    };
    match ask() {
        Ok(Some(report)) => Probe::Serving(Box::new(report)),
        // Something listens but does not answer as a daemon should: treat it as serving.
        _ => Probe::Unanswered,
    }
}

enum Probe {
    None,
    Serving(Box<StatusReport>),
    Unanswered,
    NoAccess,
}

/// Refuses when a daemon serves `dir`: `what` cannot run under it.
fn refuse_if_served(dir: &Path, name: &str, what: &str) -> Result<()> {
    let by = match probe(dir) {
        Probe::None => return Ok(()),
        Probe::Serving(r) => format!("a bulwark daemon (pid {})", r.daemon.pid),
        Probe::Unanswered | Probe::NoAccess => "a bulwark daemon".to_string(),
    };
    Err(Error::msg(format!(
        "pool {name} is being served by {by} from {}: stop it first (systemctl stop \
         bulwark@$(systemd-escape --path {}), or SIGTERM), then {what}",
        dir.display(),
        dir.display()
    )))
}

fn config_name(dir: &Path, conf: &PoolConfig) -> String {
    conf.name.clone().unwrap_or_else(|| default_pool_name(dir))
}

// ---- commands --------------------------------------------------------------------

pub fn create(args: &PoolCreateArgs) -> Result<()> {
    if args.object_store.is_none() {
        refuse_store_options_without_store(&args.store)?;
    }
    let copies = match args.layout {
        Layout::Single => 1,
        Layout::Mirror(n) => n as usize,
        Layout::Parity { k, m } => k as usize + m as usize,
    };
    let name = match &args.name {
        Some(n) => n.clone(),
        None => default_pool_name(&args.dir),
    };
    bulwark_engine::pool::format::config::validate_pool_name(&name)?;
    let dir = absolute(&args.dir);
    check_name_free(&name, &dir, None)?;
    let (spec, what) = match args.device_size {
        Some(size_bytes) => {
            let count = args.devices.unwrap_or(copies);
            if count == 0 {
                return Err(Error::usage("--devices must be at least 1"));
            }
            let what = format!("{count} device file(s) of {}", format_size(size_bytes));
            (DeviceSpec::Files { count, size_bytes }, what)
        }
        None => {
            let what = format!("{} device(s)", args.device.len());
            (DeviceSpec::Paths(args.device.clone()), what)
        }
    };
    let cache = args.cache_device.as_ref().map(|p| absolute(p));
    if let Some(c) = &cache {
        // Before the pool exists: a cache device that cannot serve refuses the create.
        bulwark_engine::cachedev::CacheDevice::check(c)?;
    }
    // The object store, before anything is made: it must honour conditions and hold no pool.
    let store = match &args.object_store {
        Some(url) => {
            if matches!(args.layout, Layout::Parity { .. }) {
                return Err(Error::usage(
                    "--object-store works with the single and mirror layouts (the store keeps \
                     the pool's durable copy); parity is not supported with it yet",
                ));
            }
            let config = crate::objects::config(&dir, url, &args.store)?;
            let store = crate::objects::open_store(&config.url, config.credentials.as_deref())?;
            crate::objects::probe(&*store, config.single_host)?;
            if store
                .get(bulwark_engine::pool::tier::SUPERBLOCK_OBJECT, 16 << 20)?
                .is_some()
            {
                return Err(Error::msg(format!(
                    "the object store {} already holds a pool: give each pool its own prefix \
                     (s3://BUCKET/PREFIX)",
                    store.describe()
                )));
            }
            Some((store, config))
        }
        None => None,
    };
    Pool::create_full(
        &args.dir,
        args.layout,
        spec,
        &name,
        &args.log_device,
        args.key_dir.as_deref(),
    )?;
    let dir = absolute(&args.dir);
    if let Some((store, config)) = store {
        let published = (|| -> Result<()> {
            let mut conf = PoolConfig::read(&dir)?;
            conf.object_store = Some(config.clone());
            conf.write(&dir)?;
            let opts = OpenOptions {
                tier: Some(crate::objects::tier_open(store, &config, true, false)),
                ..OpenOptions::default()
            };
            Pool::open(&dir, opts)?.close()?;
            Ok(())
        })();
        if let Err(e) = published {
            let _ = lifecycle::destroy(&dir, true);
            return Err(Error::msg(format!(
                "the pool could not be written to its object store: {e}; the local pool was \
                 removed again"
            )));
        }
    }
    if let Some(c) = &cache {
        set_cache_device(&dir, Some(c))?;
    }
    let mut preallocated = String::new();
    if args.preallocate {
        match preallocate(&dir) {
            Ok(bytes) => {
                preallocated = format!(", {} preallocated", format_size(bytes));
            }
            Err(e) => {
                // A pool half preallocated works, but is not what was asked: nothing stays.
                return Err(Error::msg(match lifecycle::destroy(&dir, true) {
                    Ok(_) => format!("preallocating failed: {e}; the pool was removed again"),
                    Err(d) => format!(
                        "preallocating failed: {e}; removing the pool again failed too ({d}): \
                         'bulwark pool destroy' it by hand"
                    ),
                }));
            }
        }
    }
    if let Ok(conf) = PoolConfig::read(&dir) {
        register(&name, &dir, &conf.pool_id);
    }
    let logs = match args.log_device.len() {
        0 => String::new(),
        1 => format!(", intent log on {}", args.log_device[0].display()),
        _ => format!(
            ", intent log mirrored on {}",
            args.log_device
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(" and ")
        ),
    };
    let root = bulwark_engine::pool::format::config::trust_root_dir(&dir);
    let key = root.join("pool.key");
    let mut out = format!(
        "created pool {name} in {}: layout {}, {what}{logs}{preallocated}\n",
        args.dir.display(),
        args.layout
    );
    if key.exists() {
        out.push_str(&format!(
            "pool key: {} (the pool's labels are authenticated by it: back it up away from \
             the devices; without it the pool cannot be imported)\n",
            key.display()
        ));
        let mut devices: Vec<std::path::PathBuf> = PoolConfig::read(&dir)
            .map(|c| c.devices.iter().map(|d| dir.join(d)).collect())
            .unwrap_or_else(|_| args.device.clone());
        devices.extend(args.log_device.iter().cloned());
        warn_trust_root_beside(&dir, &devices, "pool create --key-dir DIR");
    }
    print(&out)
}

/// Every device file of the pool, file-backed pools' DIR/devN.img included (issue 41): a
/// copy of the file system holding the trust root and a device (a backup of DIR, a
/// snapshot of its disk) holds the devices with the key, and restoring it rolls the pool
/// back with its anchor, silently. A warning per trust-root file that shares one.
fn warn_trust_root_beside(dir: &Path, devices: &[PathBuf], fix: &str) {
    let root = bulwark_engine::pool::format::config::trust_root_dir(dir);
    for f in [root.join("pool.key"), root.join("pool.anchor")] {
        let Ok(beside) = bulwark_engine::keys::pool_key::devices_beside(&f, devices) else {
            continue;
        };
        if !beside.is_empty() {
            eprintln!(
                "warning: {} lies on the same file system as {} device file(s) of the pool: \
                 whoever copies that file system (a backup of {}, a snapshot of its disk) gets \
                 the key with the devices, and restoring it rolls the pool back with its \
                 anchor, unseen; put them on another disk with '{fix}' (docs/runbook.md, \
                 \"Where the trust root lives\")",
                f.display(),
                beside.len(),
                dir.display()
            );
        }
    }
}

/// After an import: the trust root moved to `key_dir` when given, and where it lies, as a
/// line for the report (with the same warning `pool create` gives when it shares a file
/// system with a device file).
fn place_trust_root(dir: &Path, key_dir: Option<&Path>) -> Result<String> {
    if let Some(k) = key_dir {
        move_trust_root(dir, k).map_err(|e| {
            Error::msg(format!(
                "the pool was imported into {}, but its trust root could not be moved: {}",
                dir.display(),
                e
            ))
        })?;
    }
    let root = bulwark_engine::pool::format::config::trust_root_dir(dir);
    if let Ok(c) = PoolConfig::read(dir) {
        let devices: Vec<PathBuf> = c.devices.iter().map(|d| dir.join(d)).collect();
        warn_trust_root_beside(dir, &devices, "pool import --key-dir DIR");
    }
    Ok(format!(
        "trust root: {} (pool.key, pool.anchor): keep it off the devices' disk and back up \
         pool.key\n",
        root.display()
    ))
}

/// `pool import --key-dir K`: before the import, what would stop the trust root from
/// moving there (a file in its place, another pool's key), so that a refusal changes
/// nothing.
fn check_key_dir(k: Option<&Path>, pool_key: Option<&Path>) -> Result<()> {
    let Some(k) = k else {
        return Ok(());
    };
    if k.exists() && !k.is_dir() {
        return Err(Error::usage(format!(
            "--key-dir {} is not a directory",
            k.display()
        )));
    }
    let held = k.join("pool.key");
    if let (true, Some(given)) = (held.exists(), pool_key) {
        let same = std::fs::read(&held).ok() == std::fs::read(given).ok();
        if !same {
            return Err(Error::msg(format!(
                "--key-dir {} already holds a pool.key that is not {}: another pool's trust \
                 root; give each pool a directory of its own",
                k.display(),
                given.display()
            )));
        }
    }
    Ok(())
}

/// `pool import --key-dir K`: the imported pool's trust root (pool.key, pool.anchor) moved
/// from DIR into K (made 0700 when missing): each file written whole and synced there,
/// then pool.json names K, then DIR's copies go. A crash between leaves pool.json naming
/// a directory that holds both. Returns K as an absolute path.
fn move_trust_root(dir: &Path, k: &Path) -> Result<PathBuf> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let io = |p: &Path, e: std::io::Error| Error::msg(format!("{}: {e}", p.display()));
    if !k.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(k)
            .map_err(|e| io(k, e))?;
    }
    let k = std::fs::canonicalize(k).map_err(|e| io(k, e))?;
    let from = bulwark_engine::pool::format::config::trust_root_dir(dir);
    if std::fs::canonicalize(&from).ok().as_deref() == Some(k.as_path()) {
        return Ok(k);
    }
    let names = ["pool.key", "pool.anchor"];
    for name in names {
        let src = from.join(name);
        if !src.exists() {
            continue;
        }
        let bytes = std::fs::read(&src).map_err(|e| io(&src, e))?;
        let dst = k.join(name);
        if name == "pool.key"
            && dst.exists()
            && std::fs::read(&dst).ok().as_deref() != Some(&bytes[..])
        {
            return Err(Error::msg(format!(
                "{} already holds another pool's pool.key: the trust root stays in {}",
                k.display(),
                from.display()
            )));
        }
        let tmp = k.join(format!(".{name}.tmp"));
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)?;
            f.write_all(&bytes)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &dst)
        };
        write().map_err(|e| io(&dst, e))?;
    }
    std::fs::File::open(&k)
        .and_then(|d| d.sync_all())
        .map_err(|e| io(&k, e))?;
    let mut conf = PoolConfig::read(dir)?;
    conf.key_dir = Some(k.clone());
    conf.write(dir)?;
    for name in names {
        let _ = std::fs::remove_file(from.join(name));
    }
    Ok(k)
}

/// `pool create --preallocate`: zeros into the holes of the new pool's device files, with
/// a progress bar.
fn preallocate(dir: &Path) -> Result<u64> {
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "preallocating {bar:30} {binary_bytes}/{binary_total_bytes} ({eta})",
        )
        .expect("a valid template"),
    );
    let r = bulwark_engine::pool::create::preallocate(dir, &mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    });
    bar.finish_and_clear();
    Ok(r?)
}

/// The pool a command on a stopped pool works on: `--pool DIR` ($BULWARK_POOL), or the
/// only one registered.
fn pool_dir(pool: Option<&Path>) -> Result<PathBuf> {
    status_target(
        &PoolStatusArgs {
            target: None,
            json: false,
        },
        pool,
    )
}

/// `pool object-store add|remove`: give an existing pool a store (its data uploaded by the
/// import's commit), or forget it; no daemon may serve the pool.
pub fn object_store(command: &PoolObjectStoreCommand, pool: Option<&Path>) -> Result<()> {
    let dir = pool_dir(pool)?;
    let mut conf = PoolConfig::read(&dir)?;
    let name = config_name(&dir, &conf);
    refuse_if_served(&dir, &name, "change its object store")?;
    let args = match command {
        PoolObjectStoreCommand::Remove(r) => {
            let Some(old) = conf.object_store.take() else {
                return Err(Error::msg(format!("pool {name} has no object store")));
            };
            // Data only the store holds comes back first: without the store the pool must
            // read every byte from its own devices.
            let p = match Pool::open(&dir, OpenOptions::default()) {
                Ok(p) => p,
                Err(e) if r.force => {
                    tracing::warn!(
                        "pool {name} could not be opened with its object store ({e}): \
                         forgetting the store anyway (--force); data only the store held \
                         reads as errors"
                    );
                    conf.write(&dir)?;
                    audit(
                        &dir,
                        "pool.object_store.remove",
                        serde_json::json!({ "url": old.url, "force": true }),
                    );
                    return print(&format!(
                        "pool {name} no longer uses the object store {} (forced)\n",
                        old.url
                    ));
                }
                Err(e) => {
                    return Err(Error::msg(format!(
                        "pool {name} could not be opened with its object store {} to bring \
                         back the data only the store holds: {e}. If the store's copy is not \
                         this pool's any more (another host took it), add --force",
                        old.url
                    )))
                }
            };
            let (segments, bytes) = p.given_back();
            if segments > 0 {
                let free = free_bytes(&dir);
                if free < bytes {
                    let _ = p.close();
                    return Err(Error::msg(format!(
                        "pool {name} keeps {} of its data in the object store only, and its \
                         file system has {} free: make room first",
                        format_size(bytes),
                        format_size(free)
                    )));
                }
                eprintln!(
                    "bringing back {segments} segments ({}) from the object store...",
                    format_size(bytes)
                );
                if let Err(e) = p.bring_back_all() {
                    let _ = p.close();
                    return Err(Error::msg(format!(
                        "bringing back pool {name}'s data from the object store failed: {e}; \
                         the pool still uses the store"
                    )));
                }
            }
            p.close()?;
            conf.write(&dir)?;
            audit(
                &dir,
                "pool.object_store.remove",
                serde_json::json!({ "url": old.url }),
            );
            return print(&format!(
                "pool {name} no longer uses the object store {}: its commits stay local.\n\
                 The objects stay in the bucket, and another host can still import the pool as \
                 it was there: delete the prefix with the store's tools when it is not wanted.\n",
                old.url
            ));
        }
        PoolObjectStoreCommand::Add(a) => a,
    };
    if let Some(os) = &conf.object_store {
        return Err(Error::msg(format!(
            "pool {name} already keeps its durable copy in {} ('bulwark pool object-store \
             remove' first)",
            os.url
        )));
    }
    if conf.layout.starts_with("parity") {
        return Err(Error::usage(
            "an object store works with the single and mirror layouts; parity is not \
             supported with it yet",
        ));
    }
    if !conf.log_devices.is_empty() {
        return Err(Error::usage(
            "a pool with an object store has no separate log device ('bulwark pool log \
             remove' first)",
        ));
    }
    // The upload reads one copy of each segment without checking it (as every commit
    // does its new runs): every copy must be whole and in sync first.
    {
        let p = Pool::open(&dir, OpenOptions::default())?;
        let st = p.status();
        p.close()?;
        let unwell: Vec<String> = st
            .devices
            .iter()
            .filter(|d| d.state != "ONLINE")
            .map(|d| format!("{} is {}", d.path.display(), d.state))
            .collect();
        if !unwell.is_empty() || st.state != "ONLINE" {
            return Err(Error::msg(format!(
                "pool {name} is {} ({}): bring every device ONLINE (and let a resilver \
                 finish) before it gets an object store",
                st.state,
                unwell.join(", ")
            )));
        }
        if st.scrub.kind == "resilver" && matches!(st.scrub.state.as_str(), "scanning" | "paused") {
            return Err(Error::msg(format!(
                "pool {name} is being resilvered: let it finish ('bulwark scrub status') \
                 before it gets an object store"
            )));
        }
    }
    let config = crate::objects::config(&dir, &args.url, &args.store)?;
    let store = crate::objects::open_store(&config.url, config.credentials.as_deref())?;
    crate::objects::probe(&*store, config.single_host)?;
    conf.object_store = Some(config.clone());
    conf.write(&dir)?;
    let opened = Pool::open(
        &dir,
        OpenOptions {
            tier: Some(crate::objects::tier_open(store, &config, true, false)),
            ..OpenOptions::default()
        },
    );
    let published = opened.and_then(|p| {
        let st = p.status();
        p.close().map(|()| st)
    });
    let st = match published {
        Ok(st) => st,
        Err(e) => {
            conf.object_store = None;
            conf.write(&dir)?;
            return Err(Error::msg(format!(
                "the pool could not be written to the object store {}: {e}; pool {name} is \
                 unchanged (local only)",
                config.url
            )));
        }
    };
    audit(
        &dir,
        "pool.object_store.add",
        serde_json::json!({ "url": config.url, "writer": config.writer }),
    );
    let uploaded = st
        .object_store
        .as_ref()
        .map(|t| (t.segments_stored, t.requests.bytes_up))
        .unwrap_or_default();
    print(&format!(
        "pool {name} keeps its durable copy in {} from now on: {} segments uploaded ({})\n\
         writer '{}'; every FLUSH returns once the store has it{}\n",
        config.url,
        uploaded.0,
        format_size(uploaded.1),
        config.writer,
        if config.local_flush {
            " (--object-store-flush local: once the local devices have it)"
        } else {
            ""
        }
    ))
}

/// The object store's options given without `--object-store`: an error, not ignored.
fn refuse_store_options_without_store(a: &crate::cli::ObjectStoreArgs) -> Result<()> {
    let given = [
        (
            a.object_store_cache_size.is_some(),
            "--object-store-cache-size",
        ),
        (
            a.object_store_credentials.is_some(),
            "--object-store-credentials",
        ),
        (a.object_store_single_host, "--object-store-single-host"),
        (
            a.object_store_flush != crate::cli::FlushMode::Store,
            "--object-store-flush",
        ),
    ];
    match given.iter().find(|(on, _)| *on) {
        Some((_, name)) => Err(Error::usage(format!(
            "{name} needs --object-store URL (or 'bulwark pool object-store add' for an \
             existing pool)"
        ))),
        None => Ok(()),
    }
}

/// Bytes free for an unprivileged writer on the file system holding `dir` (0 if unknown).
fn free_bytes(dir: &Path) -> u64 {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else {
        return 0;
    };
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid NUL-terminated path and a struct of the right type.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return 0;
    }
    st.f_bavail as u64 * st.f_frsize as u64
}

/// `pool log add|remove`: import the pool (no daemon may serve it), change its log
/// devices with one commit, close it.
pub fn log(command: &PoolLogCommand, pool: Option<&Path>) -> Result<()> {
    let dir = pool_dir(pool)?;
    let conf = PoolConfig::read(&dir)?;
    let name = config_name(&dir, &conf);
    refuse_if_served(&dir, &name, "change its log devices")?;
    let p = Pool::open(&dir, OpenOptions::default())?;
    let current: Vec<PathBuf> = p
        .status()
        .log
        .map(|l| l.devices.into_iter().map(|d| d.path).collect())
        .unwrap_or_default();
    let canon = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let (new, what) = match command {
        PoolLogCommand::Add(a) => {
            let mut new = current.clone();
            new.push(a.path.clone());
            (new, format!("added log device {}", a.path.display()))
        }
        PoolLogCommand::Remove(r) => match &r.path {
            None if current.is_empty() => {
                p.close()?;
                return Err(Error::msg(format!("pool {name} has no log device")));
            }
            None => (Vec::new(), "removed every log device".to_string()),
            Some(path) => {
                let new: Vec<PathBuf> = current
                    .iter()
                    .filter(|d| *d != path && canon(d) != canon(path))
                    .cloned()
                    .collect();
                if new.len() == current.len() {
                    p.close()?;
                    return Err(Error::msg(format!(
                        "{} is not a log device of pool {name}",
                        path.display()
                    )));
                }
                (new, format!("removed log device {}", path.display()))
            }
        },
    };
    let changed = p.set_log_devices(&new);
    let closed = p.close();
    changed?;
    closed?;
    audit(&dir, "pool_log", serde_json::json!({ "log_devices": new }));
    let now = if new.is_empty() {
        "the intent log is on the pool's devices".to_string()
    } else {
        format!(
            "the intent log is on {}",
            new.iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(" and ")
        )
    };
    print(&format!("pool {name}: {what}; {now}\n"))
}

/// One row of `pool list`.
#[derive(Debug, Serialize)]
struct Listed {
    name: String,
    dir: PathBuf,
    pool_id: String,
    /// serving, exported, stopped, missing (the directory no longer holds the pool),
    /// or unknown (a daemon runs as another user).
    state: String,
    /// ONLINE, DEGRADED, FAULTED from a serving daemon.
    health: Option<String>,
    size_bytes: Option<u64>,
    used_bytes: Option<u64>,
}

fn listed(e: &Entry) -> Listed {
    let mut row = Listed {
        name: e.name.clone(),
        dir: e.dir.clone(),
        pool_id: e.pool_id.clone(),
        state: String::new(),
        health: None,
        size_bytes: None,
        used_bytes: None,
    };
    let conf = match PoolConfig::read(&e.dir) {
        Ok(c) if c.pool_id == e.pool_id => c,
        _ => {
            row.state = "missing".into();
            return row;
        }
    };
    match probe(&e.dir) {
        Probe::Serving(r) => {
            row.state = "serving".into();
            row.health = Some(r.pool.state.clone());
            row.size_bytes = Some(r.pool.space.total_bytes);
            row.used_bytes = Some(r.pool.space.used_bytes);
            return row;
        }
        Probe::Unanswered => {
            row.state = "serving".into();
            return row;
        }
        Probe::NoAccess => {
            row.state = "unknown".into();
            return row;
        }
        Probe::None => {}
    }
    row.state = if conf.exported { "exported" } else { "stopped" }.into();
    row.size_bytes = lifecycle::inspect(&e.dir).ok().map(|f| f.capacity_bytes);
    row
}

pub fn list(args: &ListArgs) -> Result<()> {
    let rows: Vec<Listed> = registered().iter().map(listed).collect();
    if args.json {
        return print_json(&rows);
    }
    if rows.is_empty() {
        return print(&format!(
            "no pools registered on this host ({})\n",
            registry_path().display()
        ));
    }
    use Align::*;
    let mut t = Table::new(&[
        ("NAME", Left),
        ("DIR", Left),
        ("STATE", Left),
        ("SIZE", Right),
        ("USED", Right),
        ("HEALTH", Left),
    ]);
    let size = |b: Option<u64>| b.map(format_size).unwrap_or_else(|| "-".into());
    for r in &rows {
        t.row(vec![
            r.name.clone(),
            r.dir.display().to_string(),
            r.state.clone(),
            size(r.size_bytes),
            size(r.used_bytes),
            r.health.clone().unwrap_or_else(|| "-".into()),
        ]);
    }
    print(&t.render(""))
}

/// The pool `pool status` means: NAME|DIR given, else `--pool`, else the only one registered.
fn status_target(args: &PoolStatusArgs, pool: Option<&Path>) -> Result<PathBuf> {
    if let Some(t) = &args.target {
        return resolve(t);
    }
    if let Some(p) = pool {
        return Ok(absolute(p));
    }
    let all = registered();
    match all.as_slice() {
        [one] => Ok(one.dir.clone()),
        [] => Err(Error::usage(
            "no pool given and none registered: use 'bulwark pool status NAME|DIR'",
        )),
        _ => Err(Error::usage(format!(
            "{} pools are registered: name one ('bulwark pool status NAME', see 'bulwark pool list')",
            all.len()
        ))),
    }
}

pub fn status(args: &PoolStatusArgs, pool: Option<&Path>) -> Result<()> {
    let dir = status_target(args, pool)?;
    match probe(&dir) {
        Probe::None => {}
        _ => {
            return client::status(&dir, &StatusArgs { json: args.json });
        }
    }
    let conf = PoolConfig::read(&dir)?;
    let found = lifecycle::inspect(&dir)?;
    let state = if conf.exported { "EXPORTED" } else { "STOPPED" };
    if args.json {
        #[derive(Serialize)]
        struct Offline<'a> {
            dir: &'a Path,
            state: &'a str,
            #[serde(flatten)]
            found: &'a FoundPool,
        }
        return print_json(&Offline {
            dir: &dir,
            state,
            found: &found,
        });
    }
    let name = if found.name.is_empty() {
        config_name(&dir, &conf)
    } else {
        found.name.clone()
    };
    let mut out = format!(
        "  pool: {name}\n    id: {}\n   dir: {}\n",
        found.pool_id,
        dir.display()
    );
    let why = if conf.exported {
        format!(
            "exported: no daemon may serve it until 'bulwark pool import --dir {}' (here) or an \
             import on another host takes it",
            dir.display()
        )
    } else {
        format!("no daemon serves it: 'bulwark serve {}'", dir.display())
    };
    out.push_str(&format!(" state: {state} ({why})\n"));
    out.push_str(&found_text(&found));
    out.push_str(&log_devices_text(&dir, &conf, &found.pool_id));
    print(&out)
}

/// The log devices pool.json lists, and whether each carries this pool's log label.
fn log_devices_text(dir: &Path, conf: &PoolConfig, pool_id: &str) -> String {
    use bulwark_engine::pool::intentlog::devices as logdev;
    let paths = conf.resolve_log(dir);
    if paths.is_empty() {
        return String::new();
    }
    let mut t = Table::new(&[("LOG DEVICE", Align::Left), ("STATE", Align::Left)]);
    for p in paths {
        let state = match bulwark_engine::device::FileDevice::open(&p) {
            Err(_) => "UNAVAIL (cannot be opened)".to_string(),
            Ok(d) => match logdev::read_label(&d) {
                Some(l) if bulwark_engine::hex::to_hex(&l.pool_id) == pool_id => {
                    "present".to_string()
                }
                Some(_) => "UNAVAIL (another pool's log device)".to_string(),
                None => "UNAVAIL (no log device label)".to_string(),
            },
        };
        t.row(vec![p.display().to_string(), state]);
    }
    format!("logs:\n\n{}", t.render("\t"))
}

/// The layout, generation, capacity and member table of a pool found on devices.
fn found_text(found: &FoundPool) -> String {
    let mut out = format!(
        "layout: {}\n   gen: {}{}\n  size: {}\nconfig:\n\n",
        found.layout,
        found.generation,
        if found.exported { " (exported)" } else { "" },
        format_size(found.capacity_bytes)
    );
    use Align::*;
    let mut t = Table::new(&[("MEMBER", Left), ("STATE", Left), ("GEN", Right)]);
    for m in &found.members {
        let place = match &m.path {
            Some(p) => p.display().to_string(),
            None => format!("<member {} id {}>", m.index, m.device_id),
        };
        let state = match &m.in_use {
            Some(_) => format!("{} (in use by a running daemon)", m.state),
            None => m.state.clone(),
        };
        t.row(vec![
            place,
            state,
            m.generation
                .map(|g| g.to_string())
                .unwrap_or_else(|| "-".into()),
        ]);
    }
    out.push_str(&t.render("\t"));
    out
}

pub fn export(args: &PoolTargetArgs) -> Result<()> {
    let dir = resolve(&args.target)?;
    let conf = PoolConfig::read(&dir)?;
    let name = config_name(&dir, &conf);
    refuse_if_served(&dir, &name, "export it")?;
    let report = lifecycle::export(&dir)?;
    audit(
        &dir,
        "pool.export",
        serde_json::json!({ "generation": report.generation }),
    );
    register(&name, &dir, &conf.pool_id);
    let mut out = format!(
        "exported pool {name} (id {}) at generation {}: its devices may now be moved\n",
        report.pool_id, report.generation
    );
    for d in &report.devices {
        out.push_str(&format!("\t{}\n", d.display()));
    }
    out.push_str(&format!(
        "import it with 'bulwark pool import --dir NEWDIR DEVICES...' (carry {}/grants.json, \
         or give --from-dir {})\n",
        dir.display(),
        dir.display()
    ));
    print(&out)
}

pub fn upgrade(args: &PoolTargetArgs) -> Result<()> {
    let dir = resolve(&args.target)?;
    let conf = PoolConfig::read(&dir)?;
    let name = config_name(&dir, &conf);
    refuse_if_served(&dir, &name, "upgrade it")?;
    eprintln!("upgrading pool {name}: importing it as it is (every map is walked and verified)...");
    let report = lifecycle::upgrade(&dir)?;
    audit(
        &dir,
        "pool.upgrade",
        serde_json::json!({ "generation": report.generation, "format": report.format }),
    );
    print(&format!(
        "upgraded pool {name} to format {} at generation {}: its labels are authenticated by \
         {}\nback up that file now, away from the devices: without it the pool cannot be \
         imported\n",
        report.format,
        report.generation,
        report.key.display()
    ))
}

/// `pool cache add|remove`: name or forget the cache device in pool.json.
pub fn cache(cmd: &PoolCacheCommand) -> Result<()> {
    let (target, path) = match cmd {
        PoolCacheCommand::Add(a) => (&a.target, Some(absolute(&a.path))),
        PoolCacheCommand::Remove(a) => (&a.target, None),
    };
    let dir = resolve(target)?;
    let conf = PoolConfig::read(&dir)?;
    let name = config_name(&dir, &conf);
    refuse_if_served(&dir, &name, "change its cache device")?;
    set_cache_device(&dir, path.as_deref())?;
    audit(
        &dir,
        "pool.cache",
        serde_json::json!({ "cache_device": path }),
    );
    match path {
        Some(p) => print(&format!(
            "pool {name}: cache device {} (used from the next start)\n",
            p.display()
        )),
        None => print(&format!("pool {name}: no cache device\n")),
    }
}

fn set_cache_device(dir: &Path, cache: Option<&Path>) -> Result<()> {
    Ok(bulwark_engine::pool::create::set_cache_device(dir, cache)?)
}

/// Appends one record to the pool's audit log (`DIR/audit.log`); a failure is a warning.
fn audit(dir: &Path, event: &str, detail: serde_json::Value) {
    match access::Audit::open(dir) {
        Ok(a) => a.record(access::Record {
            event,
            client: "owner",
            peer: "command line",
            volume: None,
            result: "ok",
            detail,
        }),
        Err(e) => eprintln!("warning: not recorded in the audit log: {e}"),
    }
}

/// The devices `pool import` reads: those given, else `--from-dir`'s, else `--dir`'s.
fn import_devices(args: &PoolImportArgs) -> Result<Vec<PathBuf>> {
    if !args.devices.is_empty() {
        return Ok(args.devices.clone());
    }
    let from = args
        .from_dir
        .as_ref()
        .or(args.dir.as_ref())
        .ok_or_else(|| {
            Error::usage("give the DEVICES to read, or --from-dir OLD_DIR, or --dir DIR")
        })?;
    let conf = PoolConfig::read(from)?;
    let mut devices: Vec<PathBuf> = conf
        .resolve(from)
        .into_iter()
        .filter(|p| p.exists())
        .collect();
    devices.push(from.clone());
    Ok(devices)
}

/// `pool import --object-store URL --dir DIR --pool-key FILE`: the pool rebuilt from its
/// store (`tier::restore`), then taken (epoch + 1) by one import of the engine.
fn import_from_store(args: &PoolImportArgs, url: &str) -> Result<()> {
    let dir = absolute(args.dir.as_ref().ok_or_else(|| {
        Error::usage("--object-store needs --dir DIR: the new pool directory to import into")
    })?);
    let key_path = args.pool_key.as_ref().ok_or_else(|| {
        Error::usage(
            "--object-store needs --pool-key FILE: the pool's key (its pool.key); the store \
             alone cannot be read without it",
        )
    })?;
    let key = bulwark_engine::keys::pool_key::PoolKey::load(key_path)?;
    check_key_dir(args.key_dir.as_deref(), Some(key_path))?;
    let config = crate::objects::config(&dir, url, &args.store)?;
    let store = crate::objects::open_store(&config.url, config.credentials.as_deref())?;
    crate::objects::probe(&*store, config.single_host)?;
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "downloading {bar:30} {binary_bytes}/{binary_total_bytes} ({eta})",
        )
        .expect("a valid template"),
    );
    let report = bulwark_engine::pool::tier::restore(
        &dir,
        &*store,
        &key,
        config.clone(),
        args.force,
        args.min_generation,
        &|done, total| {
            bar.set_length(total);
            bar.set_position(done);
        },
    )?;
    bar.finish_and_clear();
    let opts = OpenOptions {
        take_exported: true,
        rename: args.name.clone(),
        tier: Some(crate::objects::tier_open(store, &config, false, args.force)),
        ..OpenOptions::default()
    };
    let taken = Pool::open(&dir, opts).and_then(|p| p.close());
    if let Err(e) = taken {
        let _ = lifecycle::destroy(&dir, true);
        return Err(Error::msg(format!(
            "the pool was downloaded but could not be taken: {e}; {} was removed again",
            dir.display()
        )));
    }
    let trust = place_trust_root(&dir, args.key_dir.as_deref())?;
    let name = args.name.clone().unwrap_or_else(|| {
        if report.name.is_empty() {
            default_pool_name(&dir)
        } else {
            report.name.clone()
        }
    });
    register(&name, &dir, &report.pool_id);
    audit(
        &dir,
        "pool.import",
        serde_json::json!({
            "object_store": config.url,
            "generation": report.generation,
            "previous_writer": report.previous_writer,
            "force": args.force,
        }),
    );
    if args.json {
        return print_json(&report);
    }
    let left = if report.left_in_store > 0 {
        format!(
            "; {} of client data left in the store, read from it when needed (local cache {})",
            format_size(report.left_in_store),
            format_size(config.cache_bytes.unwrap_or(0))
        )
    } else {
        String::new()
    };
    print(&format!(
        "imported pool {name} (id {}) from {} into {} at generation {}: {} in {} parts{left}\n\
         it was held by '{}' (epoch {}); this host holds it now, and that one is fenced\n\
         {trust}serve it with 'bulwark serve {}'\n",
        report.pool_id,
        config.url,
        dir.display(),
        report.generation,
        format_size(report.bytes),
        report.parts,
        report.previous_writer,
        report.epoch,
        dir.display()
    ))
}

/// What `pool import` from devices asks of the engine's `import_into`.
fn import_options(args: &PoolImportArgs) -> ImportOptions {
    ImportOptions {
        force: args.force,
        rename: args.name.clone(),
        from_dir: args.from_dir.clone(),
        pool_key: args.pool_key.clone(),
        accept_rollback: args.accept_rollback,
        min_generation: args.min_generation,
    }
}

pub fn import(args: &PoolImportArgs) -> Result<()> {
    if let Some(url) = &args.object_store {
        return import_from_store(args, url);
    }
    refuse_store_options_without_store(&args.store)?;
    let devices = import_devices(args)?;
    let Some(dir) = &args.dir else {
        // What zpool import says without a pool name: what is there, and whether it imports.
        let found = lifecycle::scan(&devices)?;
        if args.json {
            return print_json(&found);
        }
        if found.is_empty() {
            return print("no bulwark labels found\n");
        }
        let mut out = String::new();
        for f in &found {
            out.push_str(&found_header(f));
            out.push_str(&found_text(f));
            match lifecycle::import_refusal(f, args.force) {
                Some(e) => out.push_str(&format!("action: cannot import: {e}\n\n")),
                None => out.push_str(&format!(
                    "action: 'bulwark pool import --dir DIR {}' imports it\n\n",
                    f.present()
                        .map(|(_, p)| p.display().to_string())
                        .collect::<Vec<_>>()
                        .join(" ")
                )),
            }
        }
        return print(&out);
    };
    let dir = absolute(dir);
    let found = lifecycle::one_pool(&devices)?;
    if !args.json {
        print(&format!("{}{}\n", found_header(&found), found_text(&found)))?;
    }
    let name = match (&args.name, found.name.is_empty()) {
        (Some(n), _) => n.clone(),
        (None, false) => found.name.clone(),
        (None, true) => default_pool_name(&dir),
    };
    check_name_free(&name, &dir, Some(&found.pool_id))?;
    check_key_dir(args.key_dir.as_deref(), args.pool_key.as_deref())?;
    let report = lifecycle::import_into(&dir, &devices, &import_options(args))?;
    let trust = place_trust_root(&dir, args.key_dir.as_deref())?;
    register(&report.name, &dir, &report.found.pool_id);
    let carried = match &args.from_dir {
        Some(old) => carry(old, &dir)?,
        None => Vec::new(),
    };
    audit(
        &dir,
        "pool.import",
        serde_json::json!({
            "generation": report.generation,
            "exported": report.found.exported,
            "force": args.force,
            "accept_rollback": args.accept_rollback,
            "carried": carried,
        }),
    );
    if args.json {
        return print_json(&report);
    }
    let mut out = format!(
        "imported pool {} (id {}) into {} at generation {}\n{trust}",
        report.name,
        report.found.pool_id,
        dir.display(),
        report.generation
    );
    for c in &carried {
        out.push_str(&format!(
            "copied {c} from {}\n",
            args.from_dir.as_ref().unwrap().display()
        ));
    }
    let locked: Vec<&str> = report
        .volumes
        .iter()
        .filter(|v| v.encryption)
        .map(|v| v.name.as_str())
        .collect();
    out.push_str(&format!(
        "volumes: {}\n",
        if report.volumes.is_empty() {
            "none".to_string()
        } else {
            report
                .volumes
                .iter()
                .map(|v| v.name.clone())
                .collect::<Vec<_>>()
                .join(", ")
        }
    ));
    out.push_str(&format!("next: 'bulwark serve {}'", dir.display()));
    if !locked.is_empty() {
        out.push_str(&format!(
            ", then 'bulwark key load VOLUME --key-file F | --passphrase-file F' for the \
             encrypted volumes ({})",
            locked.join(", ")
        ));
    }
    out.push('\n');
    if !dir.join(access::GRANTS_FILE).exists() {
        out.push_str(&format!(
            "grants: none in {} (TLS clients open nothing until 'bulwark grant add', or copy \
             the old directory's {} here before serving)\n",
            dir.display(),
            access::GRANTS_FILE
        ));
    }
    print(&out)
}

fn found_header(f: &FoundPool) -> String {
    format!(
        "  pool: {}\n    id: {}\n state: {}\n",
        f.display_name(),
        f.pool_id,
        if f.exported {
            "EXPORTED"
        } else {
            "ACTIVE (not exported: imported on some host)"
        }
    )
}

/// Copy what lives in the old pool directory and not on the devices (grants, image
/// records) into `dir`, where `dir` has none; returns what was copied.
fn carry(old: &Path, dir: &Path) -> Result<Vec<String>> {
    use std::os::unix::fs::PermissionsExt;
    let mut copied = Vec::new();
    let grants = old.join(access::GRANTS_FILE);
    let to = dir.join(access::GRANTS_FILE);
    if grants.is_file() && !to.exists() && old != dir {
        std::fs::copy(&grants, &to)
            .and_then(|_| std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o600)))
            .map_err(|e| Error::msg(format!("cannot copy {}: {e}", grants.display())))?;
        copied.push(access::GRANTS_FILE.to_string());
    }
    let images = old.join(crate::image::IMAGES_DIR);
    let to = dir.join(crate::image::IMAGES_DIR);
    if images.is_dir() && !to.exists() && old != dir {
        std::fs::create_dir_all(&to)
            .and_then(|_| std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o700)))
            .map_err(|e| Error::msg(format!("cannot create {}: {e}", to.display())))?;
        for e in std::fs::read_dir(&images).into_iter().flatten().flatten() {
            if e.path().is_file() {
                let _ = std::fs::copy(e.path(), to.join(e.file_name()));
            }
        }
        copied.push(format!("{}/", crate::image::IMAGES_DIR));
    }
    Ok(copied)
}

/// Ask for the pool's name at a terminal, as a guard against destroying the wrong pool.
fn confirm_destroy(name: &str, dir: &Path) -> Result<()> {
    crate::client::confirm_by_typing(
        name,
        &format!(
            "'pool destroy' wipes pool {name} for good: confirm by typing its name at a \
             terminal, or pass --yes"
        ),
        &format!(
            "This wipes the labels of every device of pool {name} ({}) and removes its pool \
             files: it can never be imported again.\nType the pool's name to confirm: ",
            dir.display()
        ),
        &format!("not confirmed: pool {name} is unchanged"),
    )
}

pub fn destroy(args: &PoolDestroyArgs) -> Result<()> {
    let dir = resolve(&args.target)?;
    let conf = PoolConfig::read(&dir)?;
    let name = config_name(&dir, &conf);
    refuse_if_served(&dir, &name, "destroy it")?;
    if !args.yes {
        confirm_destroy(&name, &dir)?;
    }
    let report = lifecycle::destroy(&dir, args.force)?;
    // The binary's own files: grants and image records go with the pool; the audit log
    // stays, with this last record.
    let _ = std::fs::remove_file(dir.join(access::GRANTS_FILE));
    let _ = std::fs::remove_dir_all(dir.join(crate::image::IMAGES_DIR));
    for s in [control::CONTROL_SOCKET_NAME, control::NBD_SOCKET_NAME] {
        let _ = std::fs::remove_file(dir.join(s));
    }
    audit(
        &dir,
        "pool.destroy",
        serde_json::json!({ "pool_id": report.pool_id, "wiped": report.wiped }),
    );
    update_or_warn(|pools| pools.retain(|e| e.pool_id != report.pool_id));
    let mut out = format!(
        "destroyed pool {name} (id {}): labels wiped on {} device(s)\n",
        report.pool_id,
        report.wiped.len()
    );
    for d in &report.wiped {
        out.push_str(&format!("\twiped {}\n", d.display()));
    }
    for d in &report.removed {
        out.push_str(&format!("\tremoved {}\n", d.display()));
    }
    for m in &report.missing {
        out.push_str(&format!(
            "warning: {m} was not found: its labels, wherever it is, were not wiped\n"
        ));
    }
    out.push_str(&format!(
        "kept {} (the pool's history)\n",
        dir.join(access::AUDIT_FILE).display()
    ));
    print(&out)
}
