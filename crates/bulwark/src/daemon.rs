//! `bulwark serve`: the daemon that owns one pool, exports its volumes over
//! NBD and answers the CLI on the control socket.
//!
//! Life cycle: bind the TCP listeners asked for (NBD, metrics: a refused
//! address fails before the import writes anything) → import the pool (the
//! engine takes its exclusive lock) → listen
//! on the NBD unix socket, then TCP if asked, then the control socket last, so
//! a CLI that reaches the control socket knows NBD is up too → print
//! "bulwark: serving pool ..." → on SIGTERM or SIGINT stop accepting, drain
//! NBD and control work (bounded by `DRAIN_TIMEOUT`), make the final commit
//! with `Pool::close`, remove the sockets, exit. A second signal exits at once
//! without the final commit (what was flushed is durable anyway).
//!
//! The engine is blocking: every call from here runs under `spawn_blocking`,
//! and an engine panic becomes an error answer, not a dead daemon. Sockets are
//! created mode 0600; the control socket also checks the peer's uid, which is
//! what makes it safe for the daemon to read the secret file a request names.

use std::collections::BTreeMap;
use std::future::Future;
use std::io::ErrorKind;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bulwark_engine::{Compression, OpenOptions, Pool, VolumeOptions, VolumeStatus};
use bulwark_nbd as nbd;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, UnixListener, UnixStream};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::RwLock;
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

use crate::access::{self, AccessControl};
use crate::cli::ServeArgs;
use crate::control::{
    self, to_value, ControlError, DaemonInfo, KeyStatus, Request, Response, StatusReport,
    VolumeEntry,
};
use crate::error::{Error, Result};
use crate::export::PoolExports;
use crate::grant;
use crate::keys;
use crate::maintenance;
use crate::metrics::{self, Exposition, Metrics};
use crate::notify;
use crate::volume;

/// How long a volume-level command (unload, destroy, erase) waits for NBD
/// connections that are closing to be counted out before it refuses.
const DETACH_GRACE: Duration = Duration::from_secs(2);
/// How long a grant change waits for the connections it closes to finish
/// the requests they had already sent (at most `DRAIN_WRITE_TIMEOUT` for a
/// client that stops reading; the answer then says how many still are).
const REVOKE_WAIT: Duration = Duration::from_secs(5);

/// How long shutdown waits for NBD requests and control requests to finish.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the runtime waits for stray blocking tasks after the final commit.
const RUNTIME_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause after a failed accept (for example EMFILE) before trying again.
const ACCEPT_RETRY_DELAY: Duration = Duration::from_millis(100);

pub fn serve(dir: &Path, args: &ServeArgs) -> Result<()> {
    // Before any thread starts: it edits the environment.
    let activated = crate::notify::listen_fds();
    let dir = std::fs::canonicalize(dir)
        .map_err(|e| Error::msg(format!("cannot open pool {}: {e}", dir.display())))?;
    let mut opts = OpenOptions::default();
    if let Some(cache_bytes) = args.cache_size {
        opts.cache_bytes = cache_bytes;
    }
    opts.cache_device = args.cache_device.as_ref().map(|p| absolute_path(p));
    if let Some(rate) = args.scrub_rate {
        opts.scrub_rate_bytes = rate;
    }
    if args.allow_fault_injection {
        opts.allow_fault_injection = true;
        warn!("fault injection is allowed: 'bulwark fault set' can corrupt this pool's devices");
    }
    opts.intent_log = !args.no_intent_log;
    // Holes are the daemon's default (decision 0014); the engine's own default stays off
    // for the tests that measure the cleaner alone.
    opts.fill_holes = !args.no_fill_holes;
    // Holes first too (decision 0014, "Holes first"), unless holes are off altogether.
    opts.holes_first = args.holes_first || !(args.no_holes_first || args.no_fill_holes);
    opts.defrag = !args.no_defrag;
    // A pool whose every byte is local starts while its object store does not answer.
    crate::objects::SERVE_WITHOUT_STORE.store(true, std::sync::atomic::Ordering::Release);
    if let Some(grace) = args.object_store_gc_grace {
        let conf = bulwark_engine::pool::format::config::PoolConfig::read(&dir)?;
        let os = conf.object_store.as_ref().ok_or_else(|| {
            Error::usage("--object-store-gc-grace: this pool has no object store")
        })?;
        let mut t = crate::objects::opener(&dir, os)?;
        t.gc_grace = Duration::from_secs(grace);
        opts.tier = Some(t);
    }
    if args.accept_rollback {
        opts.accept_rollback = true;
        warn!(
            "--accept-rollback: devices older than this host's last commit are taken as they are"
        );
    }
    if args.accept_log_loss {
        opts.accept_log_loss = true;
        warn!("--accept-log-loss: an intent log that lost acknowledged flushes is taken as it is");
    }
    raise_open_files_limit();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("bulwark")
        .build()
        .map_err(|e| Error::msg(format!("cannot start the runtime: {e}")))?;
    let result = runtime.block_on(run(dir, args, opts, activated));
    runtime.shutdown_timeout(RUNTIME_SHUTDOWN_TIMEOUT);
    result
}

/// Most descriptors the daemon asks for, when the hard limit allows more.
const OPEN_FILES_WANTED: libc::rlim_t = 1 << 20;

/// Raises the soft limit on open descriptors to the hard one (capped at
/// `OPEN_FILES_WANTED`). Each NBD connection on a socket holds three
/// descriptors (its reading, writing and control handles), and the soft
/// limit is often 1024 (systemd's default for services, most shells): left
/// there, the daemon would refuse connections past about 300.
fn raise_open_files_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit to the pointer we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        warn!(
            "cannot read the open-files limit: {}",
            std::io::Error::last_os_error()
        );
        return;
    }
    let wanted = lim.rlim_max.min(OPEN_FILES_WANTED);
    if lim.rlim_cur >= wanted {
        return;
    }
    let old = lim.rlim_cur;
    lim.rlim_cur = wanted;
    // SAFETY: setrlimit reads one rlimit from the pointer we pass.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } == 0 {
        debug!("open-files limit raised from {old} to {wanted}");
    } else {
        warn!(
            "cannot raise the open-files limit from {old} to {wanted}: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// A refusal's commands name the pool as DIR and its key as DIR/pool.key (the engine
/// knows neither place): this pool's own, so that the command can be run as given.
fn name_dir(message: &str, dir: &std::path::Path) -> String {
    let key = bulwark_engine::pool::format::config::key_path(dir);
    message
        .replace(" DIR/pool.key", &format!(" {}", key.display()))
        .replace(" DIR ", &format!(" {} ", dir.display()))
}

async fn run(
    dir: PathBuf,
    args: &ServeArgs,
    opts: OpenOptions,
    activated: Vec<(String, std::os::unix::net::UnixListener)>,
) -> Result<()> {
    // What the options alone decide fails before the pool is imported (an import
    // commits: a typo in --nbd-listen must not write the devices).
    let tcp_tls = tcp_security(args)?;
    let tcp = match &args.nbd_listen {
        Some(addr) => Some(bind_tcp(addr, tcp_tls.is_some()).await?),
        None => None,
    };
    let metrics_listener = match &args.metrics_listen {
        Some(addr) => Some(metrics::bind(addr, args.metrics_allow_remote).await?),
        None => None,
    };
    service_state(&format!("STATUS=importing pool {}", dir.display()));
    let pool = {
        let d = dir.clone();
        blocking(move || Ok(Pool::open(&d, opts)?))
            .await
            .map_err(|e| Error::msg(name_dir(&e.message, &dir)))?
    };
    if let Some((devices, host)) = pool.rollback_accepted() {
        let detail = serde_json::json!({
            "devices_generation": devices,
            "host_generation": host,
        });
        audit_accepted(
            &dir,
            "pool.accept_rollback",
            "serve --accept-rollback",
            detail,
        )
        .await?;
    }
    if let Some(lost) = pool.log_loss_accepted() {
        let detail = serde_json::json!({ "lost": lost });
        audit_accepted(
            &dir,
            "pool.accept_log_loss",
            "serve --accept-log-loss",
            detail,
        )
        .await?;
    }

    let served = serve_pool(
        &dir,
        args,
        pool.clone(),
        tcp_tls,
        tcp,
        metrics_listener,
        activated,
    )
    .await;

    let closed = blocking(move || Ok(pool.close()?)).await;
    match (served, closed) {
        (Ok(()), Ok(())) => {
            info!("pool closed");
            Ok(())
        }
        (Ok(()), Err(e)) => Err(Error::msg(format!("final commit failed: {e}"))),
        (Err(e), Ok(())) => Err(e),
        (Err(e), Err(c)) => Err(Error::msg(format!("{e}; and the final commit failed: {c}"))),
    }
}

/// Listen, serve until a signal (or a listener dies), then drain. Sockets are removed on return.
async fn serve_pool(
    dir: &Path,
    args: &ServeArgs,
    pool: Arc<Pool>,
    tcp_tls: Option<Arc<nbd::TlsConfig>>,
    tcp: Option<(TcpListener, String)>,
    metrics_listener: Option<(TcpListener, std::net::SocketAddr)>,
    activated: Vec<(String, std::os::unix::net::UnixListener)>,
) -> Result<()> {
    let signal_err = |e: std::io::Error| Error::msg(format!("cannot install signal handlers: {e}"));
    let mut sigterm = signal(SignalKind::terminate()).map_err(signal_err)?;
    let mut sigint = signal(SignalKind::interrupt()).map_err(signal_err)?;

    let nbd_path = args
        .nbd_socket
        .clone()
        .unwrap_or_else(|| dir.join(control::NBD_SOCKET_NAME));
    // A socket the service manager holds (socket activation: `bulwark@.socket`) outlives
    // this daemon: clients queue in it across a restart. It is never removed here.
    let passed = activated
        .into_iter()
        .find(|(name, _)| name.is_empty() || name == "nbd" || name == "unknown");
    let (nbd_listener, _nbd_file, nbd_path) = match passed {
        Some((_, l)) => {
            let path = l
                .local_addr()
                .ok()
                .and_then(|a| a.as_pathname().map(Path::to_path_buf))
                .unwrap_or(nbd_path);
            l.set_nonblocking(true)
                .and_then(|_| UnixListener::from_std(l))
                .map(|l| (l, None, path))
                .map_err(|e| {
                    Error::msg(format!("the NBD socket passed by the service manager: {e}"))
                })?
        }
        None => {
            let (l, f) = bind_private_socket(&nbd_path)?;
            (l, Some(f), nbd_path)
        }
    };
    let nbd_tcp = tcp.as_ref().map(|(_, a)| a.clone());

    let access = Arc::new(AccessControl::open(dir).map_err(Error::msg)?);
    let counters = metrics_listener
        .as_ref()
        .map(|_| Arc::new(Metrics::default()));
    let server = nbd::Server::new(
        Arc::new(PoolExports {
            pool: pool.clone(),
            access: access.clone(),
            metrics: counters.clone(),
        }),
        nbd::ServerConfig {
            max_workers_per_conn: args.nbd_threads.map_or(
                nbd::ServerConfig::default().max_workers_per_conn,
                usize::from,
            ),
            max_connections: args
                .max_connections
                .map_or(nbd::ServerConfig::default().max_connections, |n| n as usize),
            max_startups: args
                .max_startups
                .map_or(nbd::ServerConfig::default().max_startups, |n| n as usize),
            max_startups_per_address: args
                .max_startups_per_address
                .map_or(nbd::ServerConfig::default().max_startups_per_address, |n| {
                    n as usize
                }),
            tls_timeout: args.tls_timeout.map_or(
                nbd::ServerConfig::default().tls_timeout,
                std::time::Duration::from_secs,
            ),
            payload_timeout: args.payload_timeout.map_or(
                nbd::ServerConfig::default().payload_timeout,
                std::time::Duration::from_secs,
            ),
            ..nbd::ServerConfig::default()
        },
    );
    let metrics_task = match (metrics_listener, &counters) {
        (Some((listener, addr)), Some(counters)) => {
            let exposition = Exposition::new(counters, pool.clone(), server.clone());
            Some((
                tokio::spawn(metrics::serve(listener, Arc::new(exposition))),
                addr,
            ))
        }
        _ => None,
    };
    let daemon = Arc::new(Daemon {
        pool,
        server: server.clone(),
        closing: RwLock::new(false),
        euid: unsafe { libc::geteuid() },
        nbd_socket: nbd_path.clone(),
        nbd_tcp: nbd_tcp.clone(),
        fault_injection: args.allow_fault_injection,
        access,
    });

    let control_path = control::control_socket_path(dir);
    let (control_listener, _control_file) = bind_private_socket(&control_path)?;

    let mut nbd_unix_task = tokio::spawn(server.clone().serve_unix(nbd_listener));
    let mut nbd_tcp_task = tcp.map(|(l, _)| match tcp_tls {
        Some(tls) => tokio::spawn(server.clone().serve_tcp_tls(l, tls)),
        None => tokio::spawn(server.clone().serve_tcp(l)),
    });
    let control_task = tokio::spawn(control_loop(daemon.clone(), control_listener));

    let mut ready = format!(
        "bulwark: serving pool {} (nbd socket {}",
        dir.display(),
        nbd_path.display()
    );
    if let Some(addr) = &nbd_tcp {
        ready.push_str(&format!(", nbd tcp {addr}"));
    }
    if let Some((_, addr)) = &metrics_task {
        ready.push_str(&format!(", metrics http://{addr}/metrics"));
    }
    eprintln!("{ready})");
    // Both sockets listen (bound above; connections queue until accepted):
    // a service manager may start what depends on the daemon now.
    service_state(&format!(
        "READY=1\nSTATUS={})",
        ready.trim_start_matches("bulwark: ")
    ));
    info!(
        "data blocks: AES-256-GCM by {} (fastest on this CPU; BULWARK_AEAD=aws-lc|ring overrides)",
        bulwark_engine::codec::AeadBackend::chosen().name()
    );

    let tcp_stopped = async {
        match &mut nbd_tcp_task {
            Some(task) => task.await,
            None => std::future::pending().await,
        }
    };
    let mut metrics_task = metrics_task.map(|(task, _)| task);
    let metrics_stopped = async {
        match &mut metrics_task {
            Some(task) => task.await,
            None => std::future::pending().await,
        }
    };
    let outcome: Result<()> = tokio::select! {
        _ = sigterm.recv() => { info!("SIGTERM received: shutting down"); Ok(()) }
        _ = sigint.recv() => { info!("SIGINT received: shutting down"); Ok(()) }
        r = &mut nbd_unix_task => Err(listener_stopped("NBD unix socket", r)),
        r = tcp_stopped => Err(listener_stopped("NBD TCP listener", r)),
        r = metrics_stopped => Err(listener_stopped("metrics listener", r)),
    };
    if let Err(e) = &outcome {
        error!("{e}; shutting down");
    }
    service_state("STOPPING=1\nSTATUS=shutting down: draining clients, final commit");

    tokio::spawn(async move {
        tokio::select! {
            _ = sigterm.recv() => {}
            _ = sigint.recv() => {}
        }
        eprintln!("bulwark: second signal: exiting now, without the final commit");
        std::process::exit(130);
    });

    server.shutdown();
    control_task.abort();
    let deadline = Instant::now() + DRAIN_TIMEOUT;
    if tokio::time::timeout_at(deadline, server.wait_idle())
        .await
        .is_err()
    {
        warn!(
            "NBD requests still in flight after {}s; closing the pool anyway",
            DRAIN_TIMEOUT.as_secs()
        );
    }
    match tokio::time::timeout_at(deadline, daemon.closing.write()).await {
        Ok(mut closing) => *closing = true,
        Err(_) => warn!(
            "control requests still running after {}s; closing the pool anyway",
            DRAIN_TIMEOUT.as_secs()
        ),
    }
    nbd_unix_task.abort();
    if let Some(task) = nbd_tcp_task {
        task.abort();
    }
    if let Some(task) = metrics_task {
        task.abort();
    }
    outcome
}

/// Tells the service manager (systemd `Type=notify`) where the daemon is;
/// nothing without `NOTIFY_SOCKET`. A failure is logged: serving goes on.
fn service_state(state: &str) {
    match notify::notify(state) {
        Ok(sent) => {
            if sent {
                debug!("sd_notify: {}", state.replace('\n', " "));
            }
        }
        Err(e) => warn!("cannot notify the service manager ({state:?}): {e}"),
    }
}

fn listener_stopped(
    what: &str,
    r: std::result::Result<std::io::Result<()>, tokio::task::JoinError>,
) -> Error {
    match r {
        Ok(Ok(())) => Error::msg(format!("{what} stopped serving")),
        Ok(Err(e)) => Error::msg(format!("{what} failed: {e}")),
        Err(e) => Error::msg(format!("{what} crashed: {e}")),
    }
}

/// State the control handlers share.
struct Daemon {
    pool: Arc<Pool>,
    server: Arc<nbd::Server>,
    /// Requests hold it shared while they run; shutdown takes it exclusively
    /// and sets it, so the final commit never races a request.
    closing: RwLock<bool>,
    euid: u32,
    nbd_socket: PathBuf,
    nbd_tcp: Option<String>,
    fault_injection: bool,
    /// Grants and the audit log.
    access: Arc<AccessControl>,
}

async fn control_loop(daemon: Arc<Daemon>, listener: UnixListener) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                tokio::spawn(daemon.clone().connection(stream));
            }
            Err(e) => {
                warn!("control socket accept failed: {e}");
                tokio::time::sleep(ACCEPT_RETRY_DELAY).await;
            }
        }
    }
}

impl Daemon {
    async fn connection(self: Arc<Self>, stream: UnixStream) {
        match stream.peer_cred() {
            Ok(cred) if cred.uid() == self.euid || cred.uid() == 0 => {}
            Ok(cred) => {
                warn!(
                    uid = cred.uid(),
                    "refused a control connection from another user"
                );
                return;
            }
            Err(e) => {
                warn!("refused a control connection: cannot read peer credentials: {e}");
                return;
            }
        }
        let (read, mut write) = stream.into_split();
        let mut reader = BufReader::new(read);
        let mut line = Vec::new();
        loop {
            line.clear();
            let limit = control::REQUEST_BYTES_MAX as u64 + 1;
            match (&mut reader).take(limit).read_until(b'\n', &mut line).await {
                Ok(0) => return,
                Ok(_) => {}
                Err(e) => {
                    debug!("control connection: {e}");
                    return;
                }
            }
            let too_long = line.len() > control::REQUEST_BYTES_MAX;
            let response = if too_long {
                Response::from(ControlError::invalid(format!(
                    "request longer than {} bytes",
                    control::REQUEST_BYTES_MAX
                )))
            } else if line.iter().all(|b| b.is_ascii_whitespace()) {
                continue;
            } else {
                match serde_json::from_slice::<Request>(&line) {
                    Ok(request) => {
                        let audited = grant::Audited::of(&request);
                        let result = self.handle(request).await;
                        if let Some(audited) = audited {
                            audited.record(&self.access, &result).await;
                        }
                        match result {
                            Ok(v) => Response::Ok(v),
                            Err(e) => Response::from(self.poison_reason(e)),
                        }
                    }
                    Err(e) => {
                        Response::from(ControlError::invalid(format!("malformed request: {e}")))
                    }
                }
            };
            let mut out = response.to_line();
            out.push('\n');
            if write.write_all(out.as_bytes()).await.is_err() || too_long {
                return;
            }
        }
    }

    /// A pool poisoned because another host took it in the object store: a restart would
    /// be refused, so the answer says so and names what takes the pool back instead.
    fn poison_reason(&self, e: ControlError) -> ControlError {
        if e.kind != control::ErrorKind::Poisoned {
            return e;
        }
        match self.pool.status().object_store.and_then(|t| t.fenced) {
            Some(why) => ControlError::new(control::ErrorKind::Fenced, why),
            None => e,
        }
    }

    async fn handle(&self, request: Request) -> std::result::Result<Value, ControlError> {
        // The engine logs what each request changes; nothing to add here.
        let closing = self.closing.read().await;
        if *closing {
            return Err(ControlError::new(
                control::ErrorKind::Unavailable,
                "the daemon is shutting down",
            ));
        }
        let pool = self.pool.clone();
        match request {
            Request::Status => {
                let (status, faults) =
                    blocking(move || Ok((pool.status(), maintenance::armed_faults(&pool)))).await?;
                let attached = status
                    .volumes
                    .iter()
                    .map(|v| (v.name.clone(), self.server.attached(&v.name)))
                    .filter(|(_, n)| *n > 0)
                    .collect::<BTreeMap<_, _>>();
                let daemon = DaemonInfo {
                    version: env!("CARGO_PKG_VERSION").to_string(),
                    pid: std::process::id(),
                    nbd_socket: self.nbd_socket.clone(),
                    nbd_tcp: self.nbd_tcp.clone(),
                    attached,
                    fault_injection: self.fault_injection,
                };
                let trust_root = Some(control::TrustRoot::of(&status.dir));
                to_value(&StatusReport {
                    pool: status,
                    daemon,
                    faults,
                    trust_root,
                })
            }
            Request::VolumeList => {
                let volumes = blocking(move || Ok(pool.volumes())).await?;
                let entries: Vec<VolumeEntry> =
                    volumes.into_iter().map(|v| self.entry(v)).collect();
                to_value(&entries)
            }
            Request::VolumeCreate {
                name,
                size_bytes,
                block_size,
                compression,
                encryption,
                secret,
                thick,
            } => {
                let compression: Compression = compression
                    .parse()
                    .map_err(|e: bulwark_engine::Error| ControlError::from(e))?;
                match (encryption, &secret) {
                    (true, None) => {
                        return Err(ControlError::invalid(
                            "an encrypted volume needs a passphrase file or a key file",
                        ))
                    }
                    (false, Some(_)) => {
                        return Err(ControlError::invalid(
                            "a key was given for a volume without encryption",
                        ))
                    }
                    _ => {}
                }
                let opts = VolumeOptions {
                    size_bytes,
                    block_size,
                    compression,
                    encryption,
                };
                let created = {
                    let name = name.clone();
                    blocking(move || {
                        let secret = secret.as_ref().map(keys::load_secret).transpose()?;
                        pool.create_volume_provisioned(&name, opts, secret.as_ref(), thick)?;
                        drop(secret);
                        Ok(pool.volumes().into_iter().find(|v| v.name == name))
                    })
                    .await?
                };
                let created = created.ok_or_else(|| {
                    ControlError::internal(format!("volume {name} was created but is not listed"))
                })?;
                to_value(&self.entry(created))
            }
            Request::VolumeDestroy { name, recursive } => {
                self.refuse_if_attached(&name).await?;
                if recursive {
                    for s in pool.snapshot_list(Some(&name)).unwrap_or_default() {
                        self.refuse_if_attached(&s.name).await?;
                    }
                }
                let kept =
                    blocking(move || Ok(pool.destroy_volume_recursive(&name, recursive)?)).await?;
                to_value(&serde_json::json!({ "kept": kept }))
            }
            Request::VolumeResize {
                ref name,
                size_bytes,
                shrink,
            } => {
                // A shrink is refused while clients are attached (they were told the old
                // size); a grow is online.
                let name = name.clone();
                let smaller = pool
                    .volumes()
                    .iter()
                    .any(|v| v.name == name && size_bytes < v.size_bytes);
                if shrink && smaller {
                    self.refuse_if_attached(&name).await?;
                }
                let mut answer = blocking(move || volume::handle(&pool, request)).await?;
                if let Value::Object(o) = &mut answer {
                    o.insert("attached".into(), self.server.attached(&name).into());
                }
                Ok(answer)
            }
            request @ (Request::VolumeGet { .. } | Request::VolumeSet { .. }) => {
                blocking(move || volume::handle(&pool, request)).await
            }
            Request::VolumeSpace { name } => {
                let space = blocking(move || Ok(pool.volume_space(name.as_deref())?)).await?;
                to_value(&space)
            }
            Request::VolumeRollback {
                volume,
                snapshot,
                destroy_newer,
            } => {
                // A snapshot that does not exist is said at once, not after waiting for the
                // volume's clients to go.
                let all = pool.snapshot_list(Some(&volume))?;
                if !all.iter().any(|s| s.snapshot == snapshot) {
                    return Err(bulwark_engine::Error::NotFound(format!(
                        "snapshot '{volume}@{snapshot}' does not exist"
                    ))
                    .into());
                }
                self.refuse_if_attached(&volume).await?;
                if destroy_newer {
                    let newer = all.iter().skip_while(|s| s.snapshot != snapshot).skip(1);
                    for s in newer {
                        self.refuse_if_attached(&s.name).await?;
                    }
                }
                let destroyed = blocking(move || {
                    Ok(pool.volume_rollback(&volume, &snapshot, destroy_newer)?)
                })
                .await?;
                to_value(&destroyed)
            }
            Request::VolumeClone {
                volume,
                snapshot,
                name,
                secret,
                independent,
            } => {
                let created = {
                    let name = name.clone();
                    blocking(move || {
                        let secret = secret.as_ref().map(keys::load_secret).transpose()?;
                        pool.volume_clone(&volume, &snapshot, &name, secret.as_ref())?;
                        drop(secret);
                        if independent {
                            pool.key_rotate(&name)?;
                        }
                        Ok(pool.volumes().into_iter().find(|v| v.name == name))
                    })
                    .await?
                };
                let created = created.ok_or_else(|| {
                    ControlError::internal(format!("volume {name} was cloned but is not listed"))
                })?;
                to_value(&self.entry(created))
            }
            Request::SnapshotCreate { volume, snapshot } => {
                blocking(move || Ok(pool.snapshot_create(&volume, &snapshot)?)).await?;
                Ok(Value::Null)
            }
            Request::SnapshotList { volume } => {
                let list = blocking(move || Ok(pool.snapshot_list(volume.as_deref())?)).await?;
                to_value(&list)
            }
            Request::SnapshotDestroy { volume, snapshot } => {
                self.refuse_if_attached(&format!("{volume}@{snapshot}"))
                    .await?;
                let freed =
                    blocking(move || Ok(pool.snapshot_destroy(&volume, &snapshot)?)).await?;
                Ok(serde_json::json!({ "freed_bytes": freed }))
            }
            Request::SnapshotHold {
                volume,
                snapshot,
                tag,
            } => {
                blocking(move || Ok(pool.snapshot_hold(&volume, &snapshot, &tag, true)?)).await?;
                Ok(Value::Null)
            }
            Request::SnapshotRelease {
                volume,
                snapshot,
                tag,
            } => {
                blocking(move || Ok(pool.snapshot_hold(&volume, &snapshot, &tag, false)?)).await?;
                Ok(Value::Null)
            }
            Request::KeyLoad { name, secret } => {
                blocking(move || {
                    let secret = keys::load_secret(&secret)?;
                    pool.load_key(&name, &secret)
                        .map_err(|e| keys::explain(&pool, &name, e))
                    // `secret` is dropped (and zeroized) here, before the answer goes out.
                })
                .await?;
                Ok(Value::Null)
            }
            Request::KeyUnload { name } => {
                self.refuse_if_attached(&name).await?;
                blocking(move || Ok(pool.unload_key(&name)?)).await?;
                Ok(Value::Null)
            }
            request @ (Request::ScrubStart { .. }
            | Request::ScrubResume
            | Request::ScrubPause
            | Request::ScrubCancel
            | Request::ScrubStatus
            | Request::DeviceOffline { .. }
            | Request::DeviceOnline { .. }
            | Request::DeviceReplace { .. }
            | Request::FaultSet { .. }
            | Request::FaultClear { .. }
            | Request::FaultList) => blocking(move || maintenance::handle(&pool, request)).await,
            request @ (Request::KeyAdd { .. }
            | Request::KeyRemove { .. }
            | Request::KeyChange { .. }
            | Request::KeyList { .. }
            | Request::KeyRotate { .. }
            | Request::KeyErase { .. }) => {
                if let Request::KeyErase { name } = &request {
                    self.refuse_if_attached(name).await?;
                }
                blocking(move || keys::handle(&pool, request)).await
            }
            request @ (Request::GrantAdd { .. }
            | Request::GrantRemove { .. }
            | Request::GrantList) => {
                let changes = !matches!(request, Request::GrantList);
                let access = self.access.clone();
                let mut answer = blocking(move || grant::handle(&pool, &access, request)).await?;
                if changes {
                    // What a grant no longer allows, an open connection may no longer do.
                    let ids = crate::export::close_ungranted(&self.server, &self.access);
                    let open = self.server.wait_detached(&ids, REVOKE_WAIT).await;
                    if !ids.is_empty() {
                        info!(
                            closing = ids.len(),
                            still_open = open,
                            "closed the NBD connections that the grants no longer allow"
                        );
                    }
                    grant::with_closed(&mut answer, ids.len(), open);
                }
                Ok(answer)
            }
        }
    }

    fn entry(&self, volume: VolumeStatus) -> VolumeEntry {
        VolumeEntry {
            key_status: KeyStatus::of(&volume),
            attached: self.server.attached(&volume.name),
            volume,
        }
    }

    /// Refuses while NBD clients have the volume open. A client that has just
    /// disconnected (NBD_CMD_DISC carries no reply, so it may exit and its
    /// owner go on before the server has finished the connection) is given
    /// `DETACH_GRACE` to be counted out.
    async fn refuse_if_attached(&self, name: &str) -> std::result::Result<(), ControlError> {
        let deadline = Instant::now() + DETACH_GRACE;
        loop {
            match self.server.attached(name) {
                0 => return Ok(()),
                n if Instant::now() >= deadline => {
                    return Err(ControlError::new(
                        control::ErrorKind::Busy,
                        format!("volume {name} is in use by {n} NBD connection(s)"),
                    ))
                }
                _ => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
    }
}

/// Run blocking engine work off the async threads; a panic becomes an error message.
fn blocking<T, F>(f: F) -> impl Future<Output = std::result::Result<T, ControlError>>
where
    T: Send + 'static,
    F: FnOnce() -> std::result::Result<T, ControlError> + Send + 'static,
{
    let task = tokio::task::spawn_blocking(f);
    async move {
        match task.await {
            Ok(r) => r,
            Err(e) if e.is_panic() => {
                let panic = e.into_panic();
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".into());
                error!("engine call panicked: {what}");
                Err(ControlError::internal(format!(
                    "internal error in the engine: {what}"
                )))
            }
            Err(e) => Err(ControlError::internal(format!("internal error: {e}"))),
        }
    }
}

/// A socket file this daemon created; removed on drop if it is still the same file.
struct SocketFile {
    path: PathBuf,
    dev: u64,
    ino: u64,
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        if let Ok(m) = std::fs::symlink_metadata(&self.path) {
            if m.dev() == self.dev && m.ino() == self.ino {
                let _ = std::fs::remove_file(&self.path);
            }
        }
    }
}

/// Listen on a unix socket only its owner may connect to, replacing a stale socket file.
fn bind_private_socket(path: &Path) -> Result<(UnixListener, SocketFile)> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => {
            return Err(Error::msg(format!(
                "cannot use socket path {}: {e}",
                path.display()
            )))
        }
        Ok(m) if m.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(Error::msg(format!(
                    "{} is in use by another running server",
                    path.display()
                )));
            }
            std::fs::remove_file(path).map_err(|e| {
                Error::msg(format!(
                    "cannot remove stale socket {}: {e}",
                    path.display()
                ))
            })?;
        }
        Ok(_) => {
            return Err(Error::msg(format!(
                "{} exists and is not a socket; refusing to replace it",
                path.display()
            )))
        }
    }
    // The umask closes the window between bind and chmod in which another
    // user could connect. It is process-wide for that instant: anything the
    // engine creates meanwhile is only made more private.
    let old_umask = unsafe { libc::umask(0o177) };
    let bound = UnixListener::bind(path);
    unsafe { libc::umask(old_umask) };
    let listener =
        bound.map_err(|e| Error::msg(format!("cannot listen on {}: {e}", path.display())))?;
    let meta = std::fs::symlink_metadata(path)
        .and_then(|m| {
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map(|_| m)
        })
        .map_err(|e| Error::msg(format!("cannot secure {}: {e}", path.display())))?;
    Ok((
        listener,
        SocketFile {
            path: path.to_path_buf(),
            dev: meta.dev(),
            ino: meta.ino(),
        },
    ))
}

/// How the TCP listener authenticates clients: `Some` TLS configuration,
/// or `None` for plaintext (only with `--nbd-plaintext`, only on loopback:
/// checked again once bound).
fn tcp_security(args: &ServeArgs) -> Result<Option<Arc<nbd::TlsConfig>>> {
    let tls = match (&args.tls_certificates, &args.tls_psk) {
        (Some(dir), None) => Some(nbd::TlsConfig::x509(dir)),
        (None, Some(file)) => Some(nbd::TlsConfig::psk_file(file)),
        (None, None) => None,
        (Some(_), Some(_)) => {
            return Err(Error::usage(
                "--tls-certificates and --tls-psk cannot be used together",
            ))
        }
    };
    let tls = tls
        .transpose()
        .map_err(|e| Error::msg(format!("cannot set up TLS: {e}")))?;
    match (&args.nbd_listen, &tls, args.nbd_plaintext) {
        (None, Some(_), _) | (None, _, true) => Err(Error::usage(
            "TLS and --nbd-plaintext apply to the TCP listener: add --nbd-listen HOST:PORT",
        )),
        (Some(_), Some(_), true) => Err(Error::usage(
            "--nbd-plaintext cannot be combined with --tls-certificates or --tls-psk",
        )),
        (Some(_), None, false) => Err(Error::usage(
            "NBD over TCP requires TLS: add --tls-certificates DIR or --tls-psk FILE \
             (or --nbd-plaintext, on a loopback address only)",
        )),
        _ => Ok(tls.map(Arc::new)),
    }
}

async fn bind_tcp(addr: &str, tls: bool) -> Result<(TcpListener, String)> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| Error::msg(format!("cannot listen on {addr}: {e}")))?;
    let local = listener
        .local_addr()
        .map_err(|e| Error::msg(format!("cannot listen on {addr}: {e}")))?;
    if !tls && !local.ip().is_loopback() {
        return Err(Error::usage(format!(
            "--nbd-plaintext is refused on {local}: it is not a loopback address \
             (use --tls-certificates DIR or --tls-psk FILE)"
        )));
    }
    Ok((listener, local.to_string()))
}

/// `p` made absolute against the working directory (the daemon's own paths are not
/// relative to the pool directory).
fn absolute_path(p: &Path) -> PathBuf {
    std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf())
}

/// Audit what `serve` accepted on its command line (a rollback, a lost log) before it
/// serves anything.
async fn audit_accepted(
    dir: &std::path::Path,
    event: &'static str,
    client: &'static str,
    detail: serde_json::Value,
) -> Result<()> {
    let audit = access::Audit::open(dir).map_err(Error::msg)?;
    let record = move || {
        audit.record(access::Record {
            event,
            client,
            peer: "command line",
            volume: None,
            result: "ok",
            detail,
        })
    };
    tokio::task::spawn_blocking(record)
        .await
        .map_err(|e| Error::msg(format!("audit: {e}")))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn private_socket_replaces_stale_and_refuses_live_and_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        {
            let (_l, _f) = bind_private_socket(&path).unwrap();
            let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600);
            assert!(
                bind_private_socket(&path).is_err(),
                "a live socket must not be replaced"
            );
        }
        assert!(!path.exists(), "the socket is removed on drop");

        // A stale socket (listener gone, file left behind) is replaced.
        let stale = std::os::unix::net::UnixListener::bind(&path).unwrap();
        drop(stale);
        assert!(path.exists());
        let (_l, _f) = bind_private_socket(&path).unwrap();

        let file = dir.path().join("plain");
        std::fs::write(&file, b"x").unwrap();
        assert!(bind_private_socket(&file).is_err());
        assert!(file.exists());
    }
}
