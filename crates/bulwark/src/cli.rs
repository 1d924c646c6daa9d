//! The command line: every subcommand, flag and default, as clap structs.
//!
//! This file only describes arguments and checks what can be checked without
//! the daemon (sizes parse, a block size is a power of two, a key is given
//! exactly when encryption is on). Secrets never appear here: a flag names a
//! file, and only the daemon reads it.

use std::path::PathBuf;

use bulwark_engine::device::fault::FaultMode;
use bulwark_engine::Layout;
use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::error::{Error, Result};

#[derive(Debug, Parser)]
#[command(
    name = "bulwark",
    version,
    about = "Encrypted, checksummed virtual disks served over NBD",
    after_help = "'serve', 'history' and the 'pool' commands (but 'pool status' of a served \
                  pool) work without a daemon; every other command talks to the running daemon \
                  through DIR/control.sock."
)]
pub struct Cli {
    /// Pool directory of the running daemon, whose control socket commands talk to
    /// ('history' reads its audit log, daemon or not; 'pool create' and 'serve' take DIR).
    #[arg(long, global = true, env = "BULWARK_POOL", value_name = "DIR")]
    pub pool: Option<PathBuf>,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create, list, export, import and destroy pools.
    #[command(subcommand, arg = legacy_pool_arg())]
    Pool(PoolCommand),
    /// Run the daemon in the foreground: import the pool, serve NBD and the control socket.
    #[command(arg = legacy_pool_arg())]
    Serve(ServeArgs),
    /// Create, list, roll back and destroy volumes.
    #[command(subcommand)]
    Volume(VolumeCommand),
    /// Take, list, hold and destroy snapshots (VOL@SNAP): instant, read-only, served over NBD.
    #[command(subcommand, after_help = SNAPSHOT_AFTER_HELP)]
    Snapshot(SnapshotCommand),
    /// Import raw and qcow2 disk images into volumes, export volumes as images, list imports.
    #[command(subcommand, after_help = IMAGE_AFTER_HELP)]
    Image(ImageCommand),
    /// Load, unload, add, remove, change, rotate and erase the keys of encrypted volumes.
    #[command(subcommand)]
    Key(KeyCommand),
    /// Show the pool's health, devices, space and volumes.
    Status(StatusArgs),
    /// Allow TLS clients to open volumes over the network.
    #[command(subcommand, after_help = GRANT_AFTER_HELP)]
    Grant(GrantCommand),
    /// Verify every copy of every live block and repair bad copies from good ones.
    ///
    /// 'bulwark scrub' starts a scrub in the background; 'bulwark scrub --wait'
    /// starts one (or joins the one running) and shows its progress until it
    /// finishes: exit 0 when every block had a good copy, 1 when some had none.
    #[command(after_help = SCRUB_AFTER_HELP, args_conflicts_with_subcommands = true)]
    Scrub(ScrubArgs),
    /// Take devices offline and online, replace them (each resilvers what it missed).
    #[command(subcommand)]
    Device(DeviceCommand),
    /// Inject faults into devices, for drills and tests (needs 'serve --allow-fault-injection').
    #[command(subcommand, after_help = FAULT_AFTER_HELP)]
    Fault(FaultCommand),
    /// Show the pool's audit log (DIR/audit.log), one line per record, as 'zpool history' does.
    ///
    /// Reads the file itself: works with the daemon stopped. Records are
    /// attaches and detaches, refused opens and handshakes, key, grant and
    /// volume commands. Times are UTC.
    #[command(after_help = HISTORY_AFTER_HELP)]
    History(HistoryArgs),
    /// Measure a volume (or any NBD export) with fio: IOPS, MB/s, p50/p99 latency per cell.
    ///
    /// Runs fio's nbd engine over a matrix of block sizes × patterns × queue
    /// depths. The measured region is overwritten: a volume or export that
    /// holds data is refused unless --force is given.
    #[command(after_help = BENCH_AFTER_HELP)]
    Bench(BenchArgs),
    /// Serve the CSI driver (Identity, Controller, Node) for Kubernetes on a unix socket.
    ///
    /// Talks to the pool's daemon ('bulwark serve') over its control socket, as the CLI
    /// does; volumes are attached on this node through NBD. See docs/kubernetes.md.
    #[command(after_help = CSI_AFTER_HELP)]
    Csi(CsiArgs),
    /// Print a shell completion script (e.g. bulwark completions bash > /etc/bash_completion.d/bulwark).
    Completions(CompletionsArgs),
    /// Write man pages for bulwark and each of its commands into a directory (e.g. /usr/local/share/man/man1).
    Man(ManArgs),
}

#[derive(Debug, Args)]
pub struct CompletionsArgs {
    /// The shell to complete for.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

#[derive(Debug, Args)]
pub struct ManArgs {
    /// Directory to write bulwark.1 and bulwark-COMMAND.1 into (created if missing).
    pub dir: PathBuf,
}

/// The whole command tree as clap describes it (help, completions, man pages and
/// `tests/help_text.rs`, which checks every argument has help text).
pub fn command() -> clap::Command {
    use clap::CommandFactory;
    Cli::command()
}

/// The completion script for `shell`, generated from these definitions.
pub fn completions(shell: clap_complete::Shell) -> Vec<u8> {
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut command(), "bulwark", &mut script);
    script
}

/// Man pages for bulwark and every command below it, generated from these definitions;
/// returns the files written.
pub fn man_pages(dir: &std::path::Path) -> Result<Vec<PathBuf>> {
    let cannot = |p: &std::path::Path, e: std::io::Error| {
        Error::msg(format!("cannot write {}: {e}", p.display()))
    };
    std::fs::create_dir_all(dir).map_err(|e| cannot(dir, e))?;
    let mut written = Vec::new();
    let mut pending = vec![(String::from("bulwark"), command())];
    while let Some((name, cmd)) = pending.pop() {
        for sub in cmd.get_subcommands().filter(|s| s.get_name() != "help") {
            let sub_name = format!("{name}-{}", sub.get_name());
            let invoked = sub_name.replace('-', " ");
            pending.push((
                sub_name.clone(),
                sub.clone().display_name(sub_name).bin_name(invoked),
            ));
        }
        let path = dir.join(format!("{name}.1"));
        let mut page = Vec::new();
        clap_mangen::Man::new(cmd)
            .render(&mut page)
            .map_err(|e| cannot(&path, e))?;
        std::fs::write(&path, page).map_err(|e| cannot(&path, e))?;
        written.push(path);
    }
    written.sort();
    Ok(written)
}

const BENCH_AFTER_HELP: &str = "\
The region is first filled once with sequential 1M writes (so reads read data, \
not holes, and writes overwrite) and flushed (so no cell measures the writeback \
of the fill), then write cells run, then read cells. Each \
cell is one fio run: --time_based --runtime SECONDS, --jobs connections each at \
the cell's queue depth, each job on its own slice of the region. Latency is \
fio's total latency (submit to completion) per I/O. MB = 10^6 bytes. \
--fsync N makes write cells durable-write cells: an NBD FLUSH after every N \
writes (fio --fsync=N), as a VM with cache=none or a database would send.

Write amplification (WA): when the target is a volume of the daemon, each \
write cell reads the pool's space counters ('status') before and after and \
prints WA = bytes written to the pool's devices in the cell (client data, \
the cleaner's moves, metadata; every copy) / bytes fio wrote. An --uri \
target shows n/a: bench cannot see that server's pool.

Holding data: a volume holds data when its used bytes (status) are nonzero; \
an --uri export holds data when 'nbdinfo --map' reports any extent not known \
to read as zeros (a server that cannot tell reports everything as data).

Examples:
  bulwark --pool /srv/pool bench benchvol
  bulwark --pool /srv/pool bench benchvol --block-sizes 4k --patterns randread --iodepths 32 --jobs 2
  bulwark bench --uri 'nbd+unix:///disk?socket=/run/qsd.sock' --force --json";

const SNAPSHOT_AFTER_HELP: &str = "\
A snapshot holds exactly the writes that finished before 'snapshot create'
began; it costs nothing until the volume changes. Clients granted the volume
open VOL@SNAP over NBD, read-only:
  bulwark snapshot create vm1@before-upgrade
  qemu-img info 'nbd+unix:///vm1@before-upgrade?socket=DIR/nbd.sock'
  bulwark snapshot list vm1
  bulwark volume rollback vm1@before-upgrade
  bulwark snapshot destroy vm1@before-upgrade";

const CLONE_AFTER_HELP: &str = "\
One encrypted root disk per VM from one imported image, each under its own key:
  bulwark image import debian-13.qcow2 debian --key-file base.key
  bulwark volume clone debian@image vm1-root --key-file vm1.key
  bulwark volume clone debian@image vm2-root --key-file vm2.key --independent
A clone's inherited keys open only the origin's history up to the snapshot
(its blocks of that time, in any of its snapshots), never what the origin
writes after the clone. The origin snapshot cannot be destroyed while clones
depend on it; 'bulwark key rotate CLONE' (or --independent) ends that.
Destroying the origin volume keeps that snapshot, hidden, until its last
clone goes.";

const IMAGE_AFTER_HELP: &str = "\
'image import' creates the volume NAME, sized to the image's virtual size \
(rounded up to the block size), copies the image into it with qemu-img \
(zeros stay holes), takes the snapshot NAME@image, and records the sha256 of \
the image's virtual disk in DIR/images/NAME.json (what 'sha256sum' prints for \
the raw image, as 'qemu-img convert -O raw' writes it). The sha256 costs SHA-256 \
over the whole virtual size, holes included (no shortcut for zeros): ~2 GB/s on one \
core with SHA-NI, about 10 s for 20 GiB however sparse; --no-digest skips it and \
records none. An import that fails leaves no volume behind. qemu-img must \
be installed.
  bulwark image import debian-12.qcow2 vm1 --key-file /etc/bulwark/vm1.key
  bulwark image export vm1@image /tmp/vm1.qcow2 --format qcow2
  bulwark image list";

const HISTORY_AFTER_HELP: &str = "\
TIME is RFC 3339 (2024-05-01T12:00:00Z, 2024-05-01T14:00:00+02:00), a date \
(2024-05-01, midnight UTC), or an age before now: a number and s, m, h, d or w \
(30m, 1h, 2d). A last line cut short by a crash is skipped with a warning.

Examples:
  bulwark --pool /srv/pool history --since 1d
  bulwark --pool /srv/pool history --volume vm1 --client psk:backup --json";

const SCRUB_AFTER_HELP: &str = "\
A copy is rewritten only from bytes that verified against their checksum after \
being read. A block with no good copy is not written anywhere: it is listed, \
with its volume and byte range, under 'errors:' in 'bulwark status' until a \
later scrub finds a good copy. A scrub stopped by a daemon restart resumes by \
itself. See docs/scrub.md.";

const FAULT_AFTER_HELP: &str = "\
Modes: read-flip (a bit flipped in data read: bad RAM), write-flip (a bit \
flipped in data written: a bad controller), read-error, write-error (EIO), \
drop-writes (reported written, never stored), tear-writes (only the first half \
stored), misdirect-writes (stored 1 MiB further on), vanish (every I/O fails: \
an unplugged disk), slow-reads (a read waits 100 ms: a stalled queue). 'fault set' is additive: each call arms one more mode on \
the device (setting a mode again replaces it). See docs/fault-injection.md.";

const GRANT_AFTER_HELP: &str = "\
CLIENT is cn:COMMON_NAME or sha256:FINGERPRINT (of the client's X.509 certificate, \
as 'openssl x509 -noout -fingerprint -sha256' prints it), psk:IDENTITY, or anonymous \
(plaintext TCP). A TLS client lists and opens only the volumes granted to it; the \
unix socket's client is the pool owner and needs no grant.";

/// `--pool` where it does not name a running daemon (`pool create`, whose
/// DIR is the new pool, and `serve`, whose DIR is the pool to serve): still
/// accepted, so scripts that passed it keep working (`serve` falls back to
/// it when DIR is omitted, as before), but hidden from help, where the
/// global option's "of the running daemon" would be wrong. Global, so the
/// subcommands of `pool` get this copy rather than the visible one.
fn legacy_pool_arg() -> clap::Arg {
    clap::Arg::new("pool")
        .long("pool")
        .global(true)
        .hide(true)
        .env("BULWARK_POOL")
        .value_name("DIR")
        .value_parser(clap::value_parser!(PathBuf))
        .help("Pool directory (for 'serve', the same as DIR; ignored by 'pool create')")
}

#[derive(Debug, Subcommand)]
pub enum GrantCommand {
    /// Let CLIENT open VOLUME (replaces an existing grant of the same pair; narrowing it to
    /// --read-only closes the client's read-write connections to the volume).
    Add(GrantAddArgs),
    /// Take the grant back: new connections are refused, and the client's open connections
    /// to the volume that no other grant of it allows are closed (after answering the
    /// requests they are already running).
    Remove(GrantRemoveArgs),
    /// List grants.
    List(ListArgs),
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("level").required(true).args(["read_only", "read_write"])))]
pub struct GrantAddArgs {
    /// cn:NAME, sha256:FINGERPRINT, psk:IDENTITY or anonymous.
    pub client: String,
    /// The volume the client may open.
    pub volume: String,
    /// The volume is exported read-only to this client; writes get EPERM.
    #[arg(long)]
    pub read_only: bool,
    /// The client may read and write the volume.
    #[arg(long)]
    pub read_write: bool,
}

#[derive(Debug, Args)]
pub struct GrantRemoveArgs {
    /// The client whose grant goes, as it was added (cn:NAME, sha256:..., psk:IDENTITY, anonymous).
    pub client: String,
    /// The volume it may no longer open.
    pub volume: String,
}

#[derive(Debug, Subcommand)]
pub enum PoolCommand {
    /// Create a new pool in DIR.
    Create(PoolCreateArgs),
    /// List the pools known on this host: NAME, DIR, STATE (serving, exported, stopped), SIZE, USED.
    #[command(after_help = POOL_LIST_AFTER_HELP)]
    List(ListArgs),
    /// Show a pool's health, devices, space and volumes ('bulwark status' for that pool).
    ///
    /// A pool no daemon serves is shown from its devices' labels: members found,
    /// missing or stale, generation, and whether it was exported.
    Status(PoolStatusArgs),
    /// Export a pool so its devices can be moved: no daemon may serve it until it is imported.
    #[command(after_help = POOL_EXPORT_AFTER_HELP)]
    Export(PoolTargetArgs),
    /// Find a pool on devices and import it into a pool directory.
    #[command(after_help = POOL_IMPORT_AFTER_HELP)]
    Import(PoolImportArgs),
    /// Check that an object store honours conditional writes (If-None-Match, If-Match), as a
    /// pool with --object-store needs: exit 0 when it does, 1 naming the check that failed.
    #[command(after_help = POOL_PROBE_STORE_AFTER_HELP)]
    ProbeStore(PoolProbeStoreArgs),
    /// Destroy a pool: wipe the labels of every device so it can never be imported again.
    #[command(after_help = POOL_DESTROY_AFTER_HELP)]
    Destroy(PoolDestroyArgs),
    /// Upgrade a format 1 pool in place to format 2 (labels authenticated by DIR/pool.key).
    #[command(after_help = POOL_UPGRADE_AFTER_HELP)]
    Upgrade(PoolTargetArgs),
    /// Name or forget the pool's cache device in DIR/pool.json (no daemon may serve the
    /// pool; the next 'bulwark serve' uses it).
    #[command(subcommand)]
    Cache(PoolCacheCommand),
    /// Add or remove the pool's separate intent log devices (no daemon may serve it).
    #[command(subcommand)]
    Log(PoolLogCommand),
    /// Give an existing pool an object store, or forget it (no daemon may serve the pool).
    #[command(subcommand)]
    ObjectStore(PoolObjectStoreCommand),
}

#[derive(Debug, Subcommand)]
pub enum PoolObjectStoreCommand {
    /// Keep the pool's durable copy in an object store from now on: probes the store,
    /// uploads every segment that holds data, then every commit publishes to it.
    #[command(after_help = POOL_OBJECT_STORE_AFTER_HELP)]
    Add(PoolObjectStoreAddArgs),
    /// Forget the pool's object store: the pool is local only again. Data only the store
    /// holds (given back by the local cache) is brought back first. The objects stay in
    /// the bucket (delete the prefix with the store's own tools).
    #[command(after_help = POOL_OBJECT_STORE_AFTER_HELP)]
    Remove(PoolObjectStoreRemoveArgs),
}

#[derive(Debug, Args)]
pub struct PoolObjectStoreRemoveArgs {
    /// Forget the store even when the pool cannot be opened with it (another host holds
    /// it, or it does not answer): data only the store holds is then lost to this pool.
    #[arg(long)]
    pub force: bool,
}

const POOL_OBJECT_STORE_AFTER_HELP: &str = "\
The pool is --pool DIR ($BULWARK_POOL), or the only pool registered. Refused while a \
daemon serves the pool: stop it first. 'add' refuses a store that ignores conditional \
writes (unless --object-store-single-host), a prefix that already holds a pool, parity \
layouts and pools with a log device; it imports the pool, uploads its data with the \
first commit (progress in the log; a minute plus a second per 4 MiB at most), and \
closes it. See docs/object-store.md.";

#[derive(Debug, Args)]
pub struct PoolObjectStoreAddArgs {
    /// s3://BUCKET[/PREFIX][?endpoint=URL&region=REGION]
    #[arg(value_name = "URL")]
    pub url: String,
    #[command(flatten)]
    pub store: ObjectStoreArgs,
}

#[derive(Debug, Subcommand)]
pub enum PoolLogCommand {
    /// Add a log device: the intent log goes to it (a second one mirrors the log on both).
    #[command(after_help = POOL_LOG_AFTER_HELP)]
    Add(PoolLogAddArgs),
    /// Remove a log device, or without PATH every one: the log goes back to the main devices.
    #[command(after_help = POOL_LOG_AFTER_HELP)]
    Remove(PoolLogRemoveArgs),
}

const POOL_LOG_AFTER_HELP: &str = "\
The pool is --pool DIR ($BULWARK_POOL), or the only pool registered. Refused while a \
daemon serves the pool: stop it first. The command imports the pool (replaying its \
log), changes its log devices with one commit, and closes it. A new log device is an \
existing file or disk of at least 4 MiB carrying no bulwark label; a removed one has \
its label wiped. See docs/runbook.md and docs/durability.md.";

#[derive(Debug, Args)]
pub struct PoolLogAddArgs {
    /// The file or block device to use for the log.
    #[arg(value_name = "PATH")]
    pub path: PathBuf,
}

#[derive(Debug, Args)]
pub struct PoolLogRemoveArgs {
    /// The log device to remove [default: every one].
    #[arg(value_name = "PATH")]
    pub path: Option<PathBuf>,
}

const POOL_UPGRADE_AFTER_HELP: &str = "\
Format 1 pools (made by bulwark before format 2) are not served: their labels and \
metadata are not authenticated, so someone who can write the devices could change them \
undetected. The upgrade imports the pool once as it finds it (every map is walked and \
verified against its checksums), makes DIR/pool.key (32 random bytes, mode 0600) and \
writes format 2 labels to every device in two commits; data records are kept as they are. \
It authenticates the pool as it finds it: run 'bulwark scrub' on the old bulwark first if \
the devices may have been out of your hands. Refused while a daemon serves the pool. \
Back up DIR/pool.key: without it the pool cannot be imported (docs/runbook.md).";

const POOL_LIST_AFTER_HELP: &str = "\
The pools known on this host are those 'pool create' and 'pool import' put in the \
registry: /etc/bulwark/pools.json for root, $XDG_CONFIG_HOME/bulwark/pools.json \
(~/.config/bulwark/pools.json) for other users, or the file $BULWARK_REGISTRY names. \
'pool export' keeps a pool there (STATE exported); 'pool destroy' drops it. STATE is \
serving when a daemon answers on the pool's control socket; SIZE and USED come from \
that daemon (SIZE from the devices' labels when none serves the pool).";

const POOL_PROBE_STORE_AFTER_HELP: &str = "\
The probe writes one object under PREFIX/probe/ and removes it: it creates it with \
If-None-Match: * twice (the second must be refused with 412), updates it with its \
current ETag (If-Match, accepted) and with the stale one (refused). A store that \
accepts what it must refuse would let two hosts write one pool at once. 'serve' and \
'pool create --object-store' run the same probe. See docs/object-store.md.
  bulwark pool probe-store 's3://bucket/pools/tank?endpoint=http://127.0.0.1:7070' \
      --object-store-credentials /etc/bulwark/s3.env";

#[derive(Debug, Args)]
pub struct PoolProbeStoreArgs {
    /// s3://BUCKET[/PREFIX][?endpoint=URL&region=REGION]
    #[arg(value_name = "URL")]
    pub url: String,
    #[command(flatten)]
    pub store: ObjectStoreArgs,
    /// Print the checks as JSON.
    #[arg(long)]
    pub json: bool,
}

/// How to reach an object store, for the commands that take one.
#[derive(Debug, Args, Clone, Default)]
pub struct ObjectStoreArgs {
    /// A file of AWS_ACCESS_KEY_ID=..., AWS_SECRET_ACCESS_KEY=... lines (mode 0600)
    /// [default: the AWS_* environment variables].
    #[arg(long, value_name = "FILE")]
    pub object_store_credentials: Option<PathBuf>,
    /// Use a store that fails the probe (it ignores conditional writes): only one host may
    /// ever use the pool, and nothing fences a second one.
    #[arg(long)]
    pub object_store_single_host: bool,
    /// When a FLUSH returns: 'store' once the object store has it (the default), or
    /// 'local' once the local devices do (the intent log); the store then gets it with
    /// the next commit, within 5 s: a host importing from the store meanwhile does not
    /// see it. See docs/object-store.md.
    #[arg(long, value_enum, default_value = "store")]
    pub object_store_flush: FlushMode,
    /// Keep at most about SIZE of the pool on the local devices (K, M, G, T): past it,
    /// segments of client data the store holds are given back locally and read from the
    /// store (ranged GETs) from then on; map nodes always stay. With 'pool import
    /// --object-store', only the metadata is downloaded. [default: keep everything]
    #[arg(long, value_name = "SIZE", value_parser = parse_size_arg, allow_hyphen_values = true)]
    pub object_store_cache_size: Option<u64>,
}

/// `--object-store-flush`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum FlushMode {
    #[default]
    Store,
    Local,
}

const POOL_EXPORT_AFTER_HELP: &str = "\
Refused while a daemon serves the pool: stop it first (systemctl stop \
bulwark@$(systemd-escape --path DIR), or SIGTERM). Export takes the pool once, as \
serve does, and ends with a clean commit that marks every device's label exported; \
then it lets go of the devices. 'bulwark serve DIR' refuses an exported pool until \
'bulwark pool import' takes it back, here or on another host, without --force. \
DIR keeps pool.json, grants.json, audit.log and pool.anchor: carry grants.json to the \
new host with the devices (pool import --from-dir copies it). See docs/runbook.md.";

const POOL_IMPORT_AFTER_HELP: &str = "\
DEVICES are files, block devices, or directories whose device files are read (the old \
pool directory, for file-backed pools). Without DEVICES the devices are those of \
--from-dir's pool.json, else of --dir's (an exported pool taken back in place). \
Without --dir, the pools found are shown and nothing is imported.\n\n\
Import refuses a pool whose devices a running daemon holds, a pool some members \
of which are missing beyond what its layout survives, and a pool that was not \
exported (it may be in use on another host) unless --force. It writes DIR/pool.json \
naming the devices found and trusts them at the generation shown (a new \
DIR/pool.anchor), imports the pool once and closes it: then 'bulwark serve DIR'. \
Keys stay in the volume table: encrypted volumes are locked until 'bulwark key load'. \
The pool key (pool.key) is not on the devices: give it with --pool-key FILE, or \
--from-dir OLD takes OLD's. \
Grants (grants.json) live in the pool directory, not on the devices: --from-dir OLD \
copies OLD's grants.json and image records into DIR.
  bulwark pool import /dev/disk/by-id/ata-A /dev/disk/by-id/ata-B
  bulwark pool import --dir /srv/tank /dev/disk/by-id/ata-A /dev/disk/by-id/ata-B
  bulwark pool import --dir /srv/tank2 --from-dir /mnt/old/tank";

const POOL_DESTROY_AFTER_HELP: &str = "\
Refused while a daemon serves the pool. Without --yes, the pool's name must be typed \
at a terminal. Every member's four superblock slots are zeroed, the device files \
'pool create' made in DIR are removed, and so are DIR's pool.json, pool.anchor, \
pool.lock, grants.json and image records; DIR/audit.log is kept. Data on devices \
given with --device stays on them unlabelled (encrypted volumes stay encrypted: \
crypto-erase them first, 'bulwark key erase', to make it unreadable for good).";

#[derive(Debug, Args)]
pub struct PoolStatusArgs {
    /// The pool: its name in the registry ('bulwark pool list') or its directory
    /// [default: --pool DIR, or the only pool registered].
    #[arg(value_name = "NAME|DIR")]
    pub target: Option<String>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum PoolCacheCommand {
    /// Use PATH as the pool's cache device from the next start.
    Add(PoolCacheAddArgs),
    /// Stop using a cache device from the next start (the device is left as it is).
    Remove(PoolTargetArgs),
}

#[derive(Debug, Args)]
pub struct PoolCacheAddArgs {
    /// The pool: its name in the registry ('bulwark pool list') or its directory.
    #[arg(value_name = "NAME|DIR")]
    pub target: String,
    /// An existing file or block device; its first 4 KiB must be zeros or a bulwark
    /// cache label.
    #[arg(value_name = "PATH")]
    pub path: PathBuf,
}

#[derive(Debug, Args)]
pub struct PoolTargetArgs {
    /// The pool: its name in the registry ('bulwark pool list') or its directory.
    #[arg(value_name = "NAME|DIR")]
    pub target: String,
}

#[derive(Debug, Args)]
pub struct PoolImportArgs {
    /// Devices to read labels from: files, block devices, or directories of device files.
    #[arg(value_name = "DEVICES")]
    pub devices: Vec<PathBuf>,
    /// Import into this pool directory (created if missing); without it, only show what is found.
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
    /// The pool's old directory: its pool.json names the devices (when none are given), its
    /// grants.json and image records are copied into --dir.
    #[arg(long, value_name = "OLD_DIR")]
    pub from_dir: Option<PathBuf>,
    /// Import a pool that was not exported (its last host is gone for good).
    #[arg(long)]
    pub force: bool,
    /// The pool's key file (the pool.key of its old directory, or your backup of it); copied
    /// into --dir. Default: --dir's own pool.key, else --from-dir's.
    #[arg(long, value_name = "FILE")]
    pub pool_key: Option<PathBuf>,
    /// Import devices older than the generation the anchor of --dir or --from-dir last
    /// committed (an older copy restored on purpose; audited).
    #[arg(long)]
    pub accept_rollback: bool,
    /// Give the pool a new name (its labels and the registry).
    #[arg(long, value_name = "NAME")]
    pub name: Option<String>,
    /// Import the pool from this object store (s3://BUCKET/PREFIX?endpoint=...) instead
    /// of from devices: needs --dir (a new directory, where device files are made) and
    /// --pool-key. The pool is taken over (epoch + 1): a host still serving it is fenced.
    #[arg(long, value_name = "URL", conflicts_with_all = ["devices", "from_dir"])]
    pub object_store: Option<String>,
    /// Refuse a pool older than generation N, from devices or from --object-store (the
    /// generation its last host showed in 'bulwark status'): an older, authentic copy (a
    /// backup of the devices, a store whose versioning kept older states) is otherwise
    /// taken as found.
    #[arg(long, value_name = "N")]
    pub min_generation: Option<u64>,
    /// Keep the imported pool's trust root (pool.key and pool.anchor) in this directory
    /// (made 0700 if missing) instead of --dir, as 'pool create --key-dir' does: on
    /// another disk than the devices. Remembered in DIR/pool.json; see docs/runbook.md,
    /// "Where the trust root lives".
    #[arg(long, value_name = "KEY_DIR", requires = "dir")]
    pub key_dir: Option<PathBuf>,
    #[command(flatten)]
    pub store: ObjectStoreArgs,
    /// Print what was found (and imported) as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct PoolDestroyArgs {
    /// The pool: its name in the registry ('bulwark pool list') or its directory.
    #[arg(value_name = "NAME|DIR")]
    pub target: String,
    /// Do not ask for confirmation.
    #[arg(long)]
    pub yes: bool,
    /// Destroy even when the devices were written by another host since this one last did.
    #[arg(long)]
    pub force: bool,
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["device_size", "device"])))]
pub struct PoolCreateArgs {
    /// Pool directory (created if missing; must not hold a pool yet).
    pub dir: PathBuf,

    /// The pool's name (letters, digits, '.', '_', '-'; unique on this host)
    /// [default: DIR's last component].
    #[arg(long, value_name = "NAME")]
    pub name: Option<String>,

    /// How copies are laid out: single, mirror:N for N copies on N devices, or
    /// parity:K+M for K data and M parity shards on K+M devices.
    #[arg(long, value_parser = parse_layout, default_value = "single")]
    pub layout: Layout,

    /// Number of device files to create in DIR [default: 1 for single, N for mirror:N].
    #[arg(
        long,
        value_name = "N",
        requires = "device_size",
        conflicts_with = "device"
    )]
    pub devices: Option<usize>,

    /// Size of each device file to create in DIR (e.g. 256M, 10G).
    #[arg(long, value_name = "SIZE", value_parser = parse_size_arg, allow_hyphen_values = true, conflicts_with = "device")]
    pub device_size: Option<u64>,

    /// Use an existing file or block device (repeat for several).
    #[arg(long, value_name = "PATH")]
    pub device: Vec<PathBuf>,

    /// A cache device: an existing file or block device (faster than the pool's) that
    /// keeps copies of hot records, as stored (ciphertext for encrypted volumes); its
    /// first 4 KiB must be zeros or a bulwark cache label. Remembered in DIR/pool.json.
    #[arg(long, value_name = "PATH")]
    pub cache_device: Option<PathBuf>,
    /// Put the intent log on this existing file or block device (at least 4 MiB) instead
    /// of the pool's devices; give it twice to mirror the log on two.
    #[arg(long, value_name = "PATH")]
    pub log_device: Vec<PathBuf>,
    /// Keep the pool's trust root (pool.key and pool.anchor) in this directory (made
    /// 0700 if missing) instead of DIR: put it on another disk than the devices, so that a
    /// copy of the devices' file system (a backup of DIR, a snapshot of its disk) holds
    /// neither the key nor the anchor. Remembered in DIR/pool.json; see docs/runbook.md,
    /// "Where the trust root lives".
    #[arg(long, value_name = "DIR")]
    pub key_dir: Option<PathBuf>,
    /// Keep the pool's durable copy in this object store (issue 22):
    /// s3://BUCKET/PREFIX[?endpoint=URL&region=REGION]. Every commit (every FLUSH) is
    /// in the store before it is acknowledged; 'pool import --object-store' rebuilds the
    /// pool on any host from the store and the pool key. See docs/object-store.md.
    #[arg(long, value_name = "URL", conflicts_with = "log_device")]
    pub object_store: Option<String>,
    #[command(flatten)]
    pub store: ObjectStoreArgs,
    /// Write zeros into the device files (and log device files) wherever they are sparse,
    /// as qemu-img's preallocation=full: every block is allocated on the host's file
    /// system at once, so a FLUSH later syncs only the data (no block allocation in the
    /// host's journal; sync writes run about a third faster on ext4) and, on file systems
    /// that overwrite in place (ext4, XFS; not btrfs, ZFS or compressing ones), no write
    /// can fail for want of space there. Takes as long as writing the devices once. Block
    /// devices are left as they are. Not with --object-store (its local cache gives space
    /// back by punching holes).
    #[arg(long, conflicts_with = "object_store")]
    pub preallocate: bool,
}

const CSI_AFTER_HELP: &str = "Example: bulwark csi --pool /srv/pool --endpoint unix:///csi/csi.sock \
    --node-id \"$NODE_NAME\"\nSecrets (passphrase or key) come in the CSI requests; they reach the daemon \
    as 0600 files under --secrets-dir, removed after use, never on a command line.";

#[derive(Debug, Args)]
pub struct CsiArgs {
    /// Where to serve gRPC: unix:///PATH.
    #[arg(long, value_name = "unix:///PATH", env = "CSI_ENDPOINT")]
    pub endpoint: String,

    /// This node's name (Kubernetes: the node name); volumes are accessible on it.
    #[arg(long, value_name = "NAME")]
    pub node_id: String,

    /// Serve only the Controller service (with Identity): a Deployment's half.
    #[arg(long, conflicts_with = "node")]
    pub controller: bool,

    /// Serve only the Node service (with Identity): a DaemonSet's half.
    #[arg(long)]
    pub node: bool,

    /// The node's state: a file per staged volume and the nbdfuse mounts.
    #[arg(long, value_name = "DIR", default_value = "/run/bulwark-csi")]
    pub state_dir: PathBuf,

    /// Where secret files are written for the daemon, briefly (a tmpfs is best)
    /// [default: STATE_DIR/secrets].
    #[arg(long, value_name = "DIR")]
    pub secrets_dir: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Pool directory to serve [default: $BULWARK_POOL].
    pub dir: Option<PathBuf>,

    /// Unix socket for NBD clients [default: DIR/nbd.sock].
    #[arg(long, value_name = "PATH")]
    pub nbd_socket: Option<PathBuf>,

    /// Also serve NBD on TCP at HOST:PORT; needs --tls-certificates or --tls-psk
    /// (or --nbd-plaintext on loopback).
    #[arg(long, value_name = "HOST:PORT")]
    pub nbd_listen: Option<String>,

    /// TLS with X.509 on the TCP listener: DIR holds ca-cert.pem, server-cert.pem and
    /// server-key.pem; clients must present a certificate signed by that CA.
    #[arg(long, value_name = "DIR", conflicts_with = "tls_psk")]
    pub tls_certificates: Option<PathBuf>,

    /// TLS with pre-shared keys on the TCP listener: FILE holds identity:hexkey lines
    /// (psktool's format).
    #[arg(long, value_name = "FILE")]
    pub tls_psk: Option<PathBuf>,

    /// Serve plaintext NBD on the TCP listener (loopback addresses only); its clients
    /// are 'anonymous' and see only what is granted to anonymous.
    #[arg(long, conflicts_with_all = ["tls_certificates", "tls_psk"])]
    pub nbd_plaintext: bool,

    /// Bound on the block-map cache (e.g. 256M).
    #[arg(long, value_name = "SIZE", value_parser = parse_size_arg, allow_hyphen_values = true)]
    pub cache_size: Option<u64>,

    /// Use this cache device (copies of hot records) for this run, in place of the one
    /// DIR/pool.json names. One that cannot be used is warned about; the pool serves.
    #[arg(long, value_name = "PATH")]
    pub cache_device: Option<PathBuf>,

    /// Let 'bulwark fault set' inject faults into this pool's devices (drills and tests only).
    #[arg(long)]
    pub allow_fault_injection: bool,

    /// Take the devices even if they are older than the generation this host last
    /// committed (DIR/pool.anchor): you restored them from an older copy on purpose, and
    /// every write since that copy is lost.
    #[arg(long)]
    pub accept_rollback: bool,
    /// Take the pool even though its intent log lost acknowledged FLUSHes (a block missing
    /// or altered in a chain that goes on, or a log shorter than the host recorded): the
    /// writes of those flushes read as they were before them (audited; `status` shows it).
    #[arg(long)]
    pub accept_log_loss: bool,
    /// Make every client FLUSH a full commit instead of an intent log write and one
    /// device sync (for comparison; both are durable when the flush returns).
    #[arg(long)]
    pub no_intent_log: bool,
    /// Write into holes (free extents of partly-live segments) when free segments run
    /// short, instead of waiting for the cleaner alone (decision 0014). The default; the
    /// flag is kept for scripts that pass it.
    #[arg(long)]
    pub fill_holes: bool,
    /// Never write into holes: the cleaner alone makes room (overrides --fill-holes). Near
    /// full, random small overwrites then wait on cleaning that gains little: at 90% of
    /// usable space they can be refused ("cleaning is stuck").
    #[arg(long)]
    pub no_fill_holes: bool,
    /// Holes first, the default (decision 0014): near full, client writes go into the
    /// holes of any segment at least a quarter live, and the cleaner runs only for the
    /// whole segments commits need (F2FS's threaded logging), so random overwrites at
    /// 80-90% fill copy far less (BENCHMARKS.md, "Holes first"). The flag is kept for
    /// scripts that pass it.
    #[arg(long, conflicts_with_all = ["no_fill_holes", "no_holes_first"])]
    pub holes_first: bool,
    /// Holes only in segments at least 3/4 live, with the cleaner starting at the usual
    /// free-space mark: the rule before holes first became the default (for comparison).
    #[arg(long)]
    pub no_holes_first: bool,
    /// Do not defragment when idle (by default, once no client has asked anything for 5
    /// seconds, blocks scattered by random overwrites are rewritten in block order).
    #[arg(long)]
    pub no_defrag: bool,

    /// With an object store: delete objects no commit references once they are this many
    /// seconds old (an import elsewhere may still read them until then) [default: 3600].
    #[arg(long, value_name = "SECONDS")]
    pub object_store_gc_grace: Option<u64>,

    /// Scrub and resilver throttle, bytes per second (e.g. 100M) [default: 256M].
    #[arg(long, value_name = "SIZE", value_parser = parse_rate_arg)]
    pub scrub_rate: Option<u64>,

    /// Threads per NBD connection: requests of one connection in service at once
    /// (1 to 256) [default: 4].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=256))]
    pub nbd_threads: Option<u16>,

    /// NBD connections served at once; past this, new clients are told the
    /// server is full [default: 1024].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1_048_576))]
    pub max_connections: Option<u32>,

    /// TCP connections not yet authenticated (TLS not finished), from all
    /// addresses together; past this, new TCP connections are closed at once.
    /// Counted apart from --max-connections: strangers never take the place of
    /// authenticated clients or of the unix socket [default: 128].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=65_536))]
    pub max_startups: Option<u32>,

    /// The same per client address; each connection refused for it slows the
    /// address further (back-off, kept across reconnects) [default: 16].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=65_536))]
    pub max_startups_per_address: Option<u32>,

    /// Seconds a TCP connection may take, from its greeting, to finish TLS;
    /// then it is dropped and counted as a failure of its address (1 to 60)
    /// [default: 10].
    #[arg(long, value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(1..=60))]
    pub tls_timeout: Option<u64>,

    /// Seconds the rest of an NBD request (header and write payload) may take
    /// to arrive once it has begun; then the connection is closed. Idle
    /// connections may wait between requests as long as they like
    /// [default: 60].
    #[arg(long, value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub payload_timeout: Option<u64>,

    /// Serve Prometheus metrics over plain HTTP at HOST:PORT (GET /metrics); off
    /// unless given. Loopback addresses only, unless --metrics-allow-remote.
    #[arg(long, value_name = "HOST:PORT")]
    pub metrics_listen: Option<String>,

    /// Let --metrics-listen bind an address other than loopback. The endpoint has no
    /// authentication or TLS: whoever reaches it reads volume names, device paths and
    /// I/O rates.
    #[arg(long, requires = "metrics_listen")]
    pub metrics_allow_remote: bool,
}

#[derive(Debug, Args)]
pub struct ScrubArgs {
    #[command(subcommand)]
    pub command: Option<ScrubCommand>,

    /// Start a scrub (or join the running one) and show its progress until it finishes.
    #[arg(long)]
    pub wait: bool,

    /// Also check the object store's copies of the records the local devices hold (one
    /// ranged GET per run of them; no key needed). A bad copy is replaced: the record is
    /// written again from its verified local copy and uploaded by the next commit.
    #[arg(long)]
    pub verify_store: bool,
}

#[derive(Debug, Subcommand)]
pub enum ScrubCommand {
    /// Start a scrub (the same as 'bulwark scrub').
    Start(ScrubStartArgs),
    /// Pause the running scrub; 'bulwark scrub resume' continues where it stopped.
    Pause,
    /// Continue a paused scrub.
    Resume(WaitArgs),
    /// Stop the scrub; the next one starts from the beginning.
    Cancel,
    /// Show the scrub's progress and the unrecoverable ranges found.
    Status(StatusArgs),
}

#[derive(Debug, Args)]
pub struct ScrubStartArgs {
    /// Show progress until it finishes; exit 1 if a block had no good copy.
    #[arg(long)]
    pub wait: bool,

    /// Also check the object store's copies of the records the local devices hold (see
    /// 'bulwark scrub --help').
    #[arg(long)]
    pub verify_store: bool,
}

#[derive(Debug, Args)]
pub struct WaitArgs {
    /// Show progress until it finishes; exit 1 if a block had no good copy.
    #[arg(long)]
    pub wait: bool,
}

#[derive(Debug, Subcommand)]
pub enum DeviceCommand {
    /// Put NEW (an existing file or block device, at least as large) in the place of OLD and resilver onto it.
    /// NEW may be OLD's own path when a blank disk has taken the dead one's place.
    Replace(DeviceReplaceArgs),
    /// Stop using a device (mirror and parity layouts; never the last good copy).
    Offline(DevicePathArgs),
    /// Use an offline or failed device again; a resilver brings it up to date.
    Online(DeviceOnlineArgs),
}

#[derive(Debug, Args)]
pub struct DeviceReplaceArgs {
    /// The member to replace (its path as 'bulwark status' shows it).
    pub old: PathBuf,
    /// The file or block device that takes its place (may be OLD's own path).
    pub new: PathBuf,
    #[command(flatten)]
    pub wait: WaitArgs,
}

#[derive(Debug, Args)]
pub struct DevicePathArgs {
    /// A member device (its path as 'bulwark status' shows it).
    pub path: PathBuf,
}

#[derive(Debug, Args)]
pub struct DeviceOnlineArgs {
    /// A member device (its path as 'bulwark status' shows it).
    pub path: PathBuf,
    #[command(flatten)]
    pub wait: WaitArgs,
}

#[derive(Debug, Subcommand)]
pub enum FaultCommand {
    /// Arm a fault on a device, in addition to those already armed on it.
    Set(FaultSetArgs),
    /// Disarm the faults of one device, or of every device.
    Clear(FaultClearArgs),
    /// List the faults armed.
    List(ListArgs),
}

#[derive(Debug, Args)]
pub struct FaultSetArgs {
    /// A device of the pool (its path as 'bulwark status' shows it).
    pub device: PathBuf,

    /// read-flip, write-flip, read-error, write-error, drop-writes, tear-writes,
    /// misdirect-writes, vanish or slow-reads.
    #[arg(value_parser = parse_fault_mode)]
    pub mode: FaultMode,

    /// Chance that one I/O is hit, 0 to 1.
    #[arg(long, value_name = "P", default_value_t = 1.0, value_parser = parse_probability)]
    pub probability: f64,

    /// Seed of the generator that decides which I/O is hit [default: random, printed].
    #[arg(long, value_name = "N")]
    pub seed: Option<u64>,

    /// Also hit the superblock slots (labels), which are spared by default.
    #[arg(long)]
    pub include_labels: bool,
}

#[derive(Debug, Args)]
pub struct FaultClearArgs {
    /// The device to clear [default: every device].
    pub device: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
pub enum VolumeCommand {
    /// Create a volume (encrypted by default).
    Create(VolumeCreateArgs),
    /// List volumes (--space: how snapshots share their space, as 'zfs list -o space').
    List(VolumeListArgs),
    /// Destroy a volume and free its space.
    Destroy(VolumeDestroyArgs),
    /// Make a volume what it was at a snapshot (detach its clients first).
    ///
    /// Writes made since the snapshot are lost. Only the newest snapshot is a
    /// target unless --destroy-newer is given, which destroys the newer ones
    /// (as 'zfs rollback -r').
    Rollback(VolumeRollbackArgs),
    /// Clone a snapshot as a new volume under its own key: instant, no data copied.
    ///
    /// An encrypted clone opens with its own key file or passphrase alone, never
    /// the origin's. What it shares with the origin stays encrypted under the
    /// origin's data keys, of which it holds its own wrapped copies; what it
    /// writes uses a key of its own, and the origin moves to a new key at once.
    /// --independent re-encrypts every inherited block in the background and then
    /// drops the inherited keys: afterwards nothing of the clone opens with the
    /// origin's keys, and the clone no longer depends on the origin.
    #[command(after_help = CLONE_AFTER_HELP)]
    Clone(VolumeCloneArgs),
    /// Grow a volume online, or shrink it (--shrink) when nothing is stored past the new end.
    #[command(after_help = VOLUME_RESIZE_AFTER_HELP)]
    Resize(VolumeResizeArgs),
    /// Show a volume's properties (one, or all).
    #[command(after_help = VOLUME_PROPERTIES_HELP)]
    Get(VolumeGetArgs),
    /// Change a volume's properties: compression, description, readonly.
    #[command(after_help = VOLUME_PROPERTIES_HELP)]
    Set(VolumeSetArgs),
}

const VOLUME_RESIZE_AFTER_HELP: &str = "\
A grow takes effect at once for new NBD connections; a client already connected \
keeps the size it was given at its handshake until it reconnects (NBD fixes the \
size per connection): detach and attach again, then grow the file system \
(resize2fs, xfs_growfs). A shrink is refused while clients are attached, and \
when any block past the new end holds data (it says how many bytes): shrink the \
file system and trim (fstrim) first. Any volume resizes: with snapshots, a clone, \
the origin of clones; each snapshot keeps the size it was taken at (VOL@SNAP \
exports it, a rollback brings it back). A thick volume's reservation grows \
with it, and the grow is refused when the pool cannot hold it.
  bulwark volume resize vm1 20G
  bulwark volume resize vm1 8G --shrink";

const VOLUME_PROPERTIES_HELP: &str = "\
Settable: compression (off|lz4; applies to new writes), description (free text, up \
to 256 characters), readonly (on|off: the volume is exported read-only and every \
write is refused; a client attached before keeps its connection but its writes fail). \
Read-only: size, blocksize, encryption, keystatus, used (the volume and its \
snapshots), referenced, origin, snapshots, created, provisioning (thin or thick), \
reservation.
  bulwark volume get vm1
  bulwark volume get vm1 compression
  bulwark volume set vm1 readonly=on description='web server, ticket 1234'";

#[derive(Debug, Args)]
pub struct VolumeResizeArgs {
    /// Volume name.
    pub name: String,
    /// The new size (e.g. 20G), a whole number of the volume's blocks.
    #[arg(value_name = "SIZE", value_parser = parse_size_arg, allow_hyphen_values = true)]
    pub size: u64,
    /// Allow the new size to be smaller (only when nothing is stored past it).
    #[arg(long)]
    pub shrink: bool,
}

#[derive(Debug, Args)]
pub struct VolumeGetArgs {
    /// Volume name.
    pub name: String,
    /// One property, or all.
    #[arg(value_name = "PROPERTY", default_value = "all")]
    pub property: String,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct VolumeSetArgs {
    /// Volume name.
    pub name: String,
    /// PROPERTY=VALUE, one or more (compression=lz4, readonly=on, description=TEXT).
    #[arg(value_name = "PROPERTY=VALUE", required = true, value_parser = parse_assignment)]
    pub assignments: Vec<(String, String)>,
}

fn parse_assignment(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((p, v)) if !p.is_empty() => Ok((p.to_string(), v.to_string())),
        _ => Err(format!("'{s}' is not PROPERTY=VALUE")),
    }
}

#[derive(Debug, Args)]
pub struct VolumeCloneArgs {
    /// The snapshot to clone, as VOL@SNAP.
    pub snapshot: String,
    /// The new volume's name.
    pub name: String,
    /// The clone's own secret (required when the snapshot is encrypted).
    #[command(flatten)]
    pub secret: SecretArgs,
    /// Re-encrypt every inherited block under the clone's own key and drop the inherited keys.
    #[arg(long)]
    pub independent: bool,
}

#[derive(Debug, Args)]
pub struct VolumeListArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Show space: USED (volume and snapshots), REFER, USEDSNAP, WRITTEN since the newest snapshot.
    #[arg(long)]
    pub space: bool,
}

#[derive(Debug, Args)]
pub struct VolumeRollbackArgs {
    /// The snapshot to roll back to, as VOL@SNAP.
    pub snapshot: String,
    /// Destroy the snapshots newer than it (refused without, when there are any).
    #[arg(long)]
    pub destroy_newer: bool,
}

#[derive(Debug, Subcommand)]
pub enum SnapshotCommand {
    /// Snapshot a volume as VOL@SNAP: one commit, no data copied.
    Create(SnapshotNameArgs),
    /// List snapshots: USED (what destroying it frees), REFER, CREATED, HOLDS.
    List(SnapshotListArgs),
    /// Destroy a snapshot and free what only it holds (refused while held or attached).
    Destroy(SnapshotNameArgs),
    /// Keep a snapshot from being destroyed until the hold TAG is released
    /// (`zfs hold`'s order, TAG VOL@SNAP, is taken too).
    Hold(SnapshotTagArgs),
    /// Release the hold TAG on a snapshot (TAG VOL@SNAP is taken too).
    Release(SnapshotTagArgs),
}

#[derive(Debug, Args)]
pub struct SnapshotNameArgs {
    /// The snapshot, as VOL@SNAP.
    pub snapshot: String,
}

#[derive(Debug, Args)]
pub struct SnapshotTagArgs {
    /// The snapshot, as VOL@SNAP.
    pub snapshot: String,
    /// The hold's tag (letters, digits, '.', '_', '-').
    pub tag: String,
}

#[derive(Debug, Args)]
pub struct SnapshotListArgs {
    /// Only this volume's snapshots.
    pub volume: Option<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum ImageCommand {
    /// Import a raw or qcow2 image as a new volume NAME, snapshot it as NAME@image and
    /// record its sha256.
    Import(ImageImportArgs),
    /// Write a volume or snapshot (VOL or VOL@SNAP) to an image file (raw or qcow2), holes kept.
    Export(ImageExportArgs),
    /// List the imported images: size, format, sha256, when, and whether NAME@image is still there.
    List(ListArgs),
    /// Forget the record of image NAME whose snapshot NAME@image is gone (a `missing`
    /// row of 'image list'); refused while NAME@image exists.
    Forget(ImageForgetArgs),
}

#[derive(Debug, Args)]
pub struct ImageForgetArgs {
    /// The image's name (the volume it was imported as).
    pub name: String,
}

/// Disk image formats bulwark imports and exports (through qemu-img).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ImageFormat {
    Raw,
    Qcow2,
}

impl ImageFormat {
    /// The name qemu-img uses.
    pub fn as_str(self) -> &'static str {
        match self {
            ImageFormat::Raw => "raw",
            ImageFormat::Qcow2 => "qcow2",
        }
    }
}

#[derive(Debug, Args)]
pub struct ImageImportArgs {
    /// The image file (or block device) to import.
    pub file: PathBuf,

    /// Name of the new volume; the image is kept as its snapshot NAME@image.
    pub name: String,

    /// The image's format [default: detected with 'qemu-img info'; only raw and qcow2].
    #[arg(long, value_enum)]
    pub format: Option<ImageFormat>,

    /// Record no sha256: skips hashing the snapshot, which costs SHA-256 over the
    /// image's whole virtual size (~10 s for 20 GiB), even for a sparse image.
    #[arg(long)]
    pub no_digest: bool,

    #[command(flatten)]
    pub settings: VolumeSettingsArgs,
}

#[derive(Debug, Args)]
pub struct ImageExportArgs {
    /// The volume or snapshot to export, as VOL or VOL@SNAP (a snapshot is a consistent copy).
    pub source: String,

    /// The image file to write (created mode 0600: it holds the volume's data in the clear).
    pub file: PathBuf,

    /// Format of the image written.
    #[arg(long, value_enum, default_value = "raw")]
    pub format: ImageFormat,

    /// Overwrite FILE if it exists.
    #[arg(long)]
    pub force: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CompressionArg {
    Off,
    Lz4,
}

impl CompressionArg {
    pub fn as_str(self) -> &'static str {
        match self {
            CompressionArg::Off => "off",
            CompressionArg::Lz4 => "lz4",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OnOff {
    On,
    Off,
}

#[derive(Debug, Args)]
pub struct VolumeCreateArgs {
    /// Name of the new volume (its NBD export name).
    pub name: String,

    /// Size of the virtual disk (e.g. 10G).
    #[arg(long, value_name = "SIZE", value_parser = parse_size_arg, allow_hyphen_values = true)]
    pub size: u64,

    /// Reserve the volume's full size in the pool now (refused when the pool cannot hold
    /// it); without it the volume is thin: space is taken as it is written, and a pool
    /// may promise more than it has (a warning says so).
    #[arg(long)]
    pub thick: bool,

    #[command(flatten)]
    pub settings: VolumeSettingsArgs,
}

/// How a new volume stores its blocks, and the secret of an encrypted one:
/// the options `volume create` and `image import` share.
#[derive(Debug, Args)]
pub struct VolumeSettingsArgs {
    /// Block size: a power of two from 4K to 128K.
    #[arg(long, value_name = "SIZE", value_parser = parse_block_size, default_value = "4K")]
    pub block_size: u32,

    /// Compress blocks that shrink (lz4), or store them as written (off).
    #[arg(long, value_enum, default_value = "lz4")]
    pub compression: CompressionArg,

    /// Encrypt the volume (AES-256-GCM); on needs --passphrase-file or --key-file.
    #[arg(long, value_enum, default_value = "on")]
    pub encryption: OnOff,

    #[command(flatten)]
    pub secret: SecretArgs,
}

impl VolumeSettingsArgs {
    /// The key file, checked against `--encryption`.
    pub fn secret_for_encryption(&self) -> Result<Option<SecretFile>> {
        let secret = self.secret.file();
        match (self.encryption, secret) {
            (OnOff::On, Some(s)) => Ok(Some(s)),
            (OnOff::On, None) => Err(Error::usage(
                "an encrypted volume needs --passphrase-file PATH or --key-file PATH \
                 (or --encryption off for a plain volume)",
            )),
            (OnOff::Off, Some(s)) => Err(Error::usage(format!(
                "--{} was given with --encryption off; drop one of them",
                s.kind.flag()
            ))),
            (OnOff::Off, None) => Ok(None),
        }
    }
}

/// Where an unlock secret comes from: a file, never argv.
#[derive(Debug, Args)]
pub struct SecretArgs {
    /// File holding the passphrase (newlines at its end, \n or \r\n, are ignored; other whitespace counts).
    #[arg(long, value_name = "PATH", conflicts_with = "key_file")]
    pub passphrase_file: Option<PathBuf>,

    /// File holding exactly 32 random bytes (head -c 32 /dev/urandom > key).
    #[arg(long, value_name = "PATH")]
    pub key_file: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SecretKind {
    Passphrase,
    Key,
}

impl SecretKind {
    pub fn flag(self) -> &'static str {
        match self {
            SecretKind::Passphrase => "passphrase-file",
            SecretKind::Key => "key-file",
        }
    }
}

#[derive(Debug, Clone)]
pub struct SecretFile {
    pub kind: SecretKind,
    pub path: PathBuf,
}

impl SecretArgs {
    pub fn file(&self) -> Option<SecretFile> {
        match (&self.passphrase_file, &self.key_file) {
            (Some(p), _) => Some(SecretFile {
                kind: SecretKind::Passphrase,
                path: p.clone(),
            }),
            (None, Some(k)) => Some(SecretFile {
                kind: SecretKind::Key,
                path: k.clone(),
            }),
            (None, None) => None,
        }
    }
}

#[derive(Debug, Args)]
pub struct ListArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct NameArgs {
    /// Volume name.
    pub name: String,
}

#[derive(Debug, Subcommand)]
pub enum KeyCommand {
    /// Unlock an encrypted volume so it can be exported.
    Load(KeyLoadArgs),
    /// Lock an encrypted volume again (refused while it is attached).
    Unload(NameArgs),
    /// Add a key slot for another passphrase or key file (the volume's key must be loaded).
    Add(KeyLoadArgs),
    /// Remove the passphrase or key file: every key slot it opens goes (never the last one).
    #[command(after_help = KEY_REMOVE_AFTER_HELP)]
    Remove(KeyLoadArgs),
    /// Give the slot OLD opens a new secret; the other slots and the data are not touched.
    #[command(after_help = KEY_CHANGE_AFTER_HELP)]
    Change(KeyChangeArgs),
    /// List the key slots: their kind and cost, nothing secret.
    List(KeyListArgs),
    /// Start a key rotation: new writes use a new data key at once, old blocks are
    /// re-encrypted in the background, then the old data key is destroyed (kept while
    /// snapshots still hold blocks under it). On a paused rotation, resume it.
    #[command(after_help = KEY_ROTATE_AFTER_HELP)]
    Rotate(KeyRotateArgs),
    /// Crypto-erase: destroy every key slot and data key; the volume's data is
    /// unrecoverable at once, whoever holds the old passphrase or key file.
    #[command(after_help = KEY_ERASE_AFTER_HELP)]
    Erase(KeyEraseArgs),
}

const KEY_REMOVE_AFTER_HELP: &str = "\
Removes the supplied passphrase or key file from the volume (what cryptsetup's \
luksRemoveKey promises): afterwards it opens no slot. If it opens more than one \
slot (possible on volumes whose secrets were changed before 'key change' refused \
a secret already in use), every one of them is removed and each is named. \
Refused, and nothing removed, when no slot would be left: add a slot for another \
secret first, or use 'bulwark key erase' to destroy the data on purpose. The \
slots after a removed one are renumbered.";

const KEY_CHANGE_AFTER_HELP: &str = "\
The new secret must not already open another slot of the volume (as with 'key \
add'): one secret opens one slot, so 'key remove' and 'key change' act on every \
place a secret opens the volume.";

const KEY_ROTATE_AFTER_HELP: &str = "\
A rotation that cannot go on pauses where it is, recorded with its reason \
('bulwark status'). Paused because the pool is full, it goes on by itself once \
space is free; after any other error, 'bulwark key rotate NAME' resumes it; \
after a restart or 'key unload', loading the key resumes it. --wait fails \
(exit 1) when the rotation pauses, saying why; the rotation stays recorded.";

const KEY_ERASE_AFTER_HELP: &str = "\
The volume table is sealed under a key kept only in the superblocks; erase \
replaces that key and rewrites every superblock slot on every device, so older \
copies of the table left in free space cannot be decrypted either. Without \
--yes, the volume's name must be typed at a terminal to confirm. The volume \
stays, locked for good: 'bulwark volume destroy' frees its space.";

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("old_secret").required(true).args(["passphrase_file", "key_file"])))]
#[command(group(clap::ArgGroup::new("new_secret").required(true).args(["new_passphrase_file", "new_key_file"])))]
pub struct KeyChangeArgs {
    /// Volume name.
    pub name: String,
    /// The current secret (it picks the slot to change).
    #[command(flatten)]
    pub old: SecretArgs,
    /// File holding the new passphrase (newlines at its end are ignored, as for --passphrase-file).
    #[arg(long, value_name = "PATH", conflicts_with = "new_key_file")]
    pub new_passphrase_file: Option<PathBuf>,
    /// File holding the new 32-byte key.
    #[arg(long, value_name = "PATH")]
    pub new_key_file: Option<PathBuf>,
}

impl KeyChangeArgs {
    pub fn new_secret(&self) -> Option<SecretFile> {
        SecretArgs {
            passphrase_file: self.new_passphrase_file.clone(),
            key_file: self.new_key_file.clone(),
        }
        .file()
    }
}

#[derive(Debug, Args)]
pub struct KeyListArgs {
    /// Volume name.
    pub name: String,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct KeyRotateArgs {
    /// Volume name.
    pub name: String,
    /// Show the re-encryption's progress until it finishes (exit 1 if it pauses).
    #[arg(long)]
    pub wait: bool,
}

#[derive(Debug, Args)]
pub struct KeyEraseArgs {
    /// Volume name.
    pub name: String,
    /// Do not ask for confirmation.
    #[arg(long)]
    pub yes: bool,
}

#[derive(Debug, Args)]
pub struct VolumeDestroyArgs {
    #[command(flatten)]
    pub volume: NameArgs,
    /// Crypto-erase the volume's keys first (as 'bulwark key erase --yes'), then destroy it.
    #[arg(long)]
    pub crypto_erase: bool,
    /// Destroy its snapshots too (a volume with snapshots is refused without).
    #[arg(short, long)]
    pub recursive: bool,
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("secret_source").required(true).args(["passphrase_file", "key_file"])))]
pub struct KeyLoadArgs {
    /// Volume name.
    pub name: String,
    #[command(flatten)]
    pub secret: SecretArgs,
}

#[derive(Debug, Args)]
pub struct HistoryArgs {
    /// Print the matching records as JSON lines, as they are in the log.
    #[arg(long)]
    pub json: bool,

    /// Only records about this volume.
    #[arg(long, value_name = "NAME")]
    pub volume: Option<String>,

    /// Only records of this client (owner, cn:NAME, sha256:..., psk:IDENTITY, anonymous).
    #[arg(long, value_name = "CLIENT")]
    pub client: Option<String>,

    /// Only records of this event (attach, detach, key_load, grant_add, volume_create, ...).
    #[arg(long, value_name = "EVENT")]
    pub event: Option<String>,

    /// Only records at or after TIME.
    #[arg(long, value_name = "TIME")]
    pub since: Option<String>,

    /// Only records at or before TIME.
    #[arg(long, value_name = "TIME")]
    pub until: Option<String>,
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Pattern {
    Randread,
    Randwrite,
    Read,
    Write,
}

impl Pattern {
    /// fio's `--rw` value, also the name in tables and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Pattern::Randread => "randread",
            Pattern::Randwrite => "randwrite",
            Pattern::Read => "read",
            Pattern::Write => "write",
        }
    }

    pub fn is_read(self) -> bool {
        matches!(self, Pattern::Randread | Pattern::Read)
    }
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["volume", "uri"])))]
pub struct BenchArgs {
    /// Volume to measure (its key must be loaded); served from the daemon's NBD socket.
    pub volume: Option<String>,

    /// Measure any NBD export instead of a volume (nbd://HOST/NAME, nbd+unix:///NAME?socket=PATH).
    #[arg(long, value_name = "URI", conflicts_with = "volume")]
    pub uri: Option<String>,

    /// Block sizes, comma-separated (512 bytes to 32M, multiples of 512).
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        default_value = "4k,64k,1m",
        value_parser = parse_bench_block_size
    )]
    pub block_sizes: Vec<u64>,

    /// Access patterns, comma-separated.
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        value_enum,
        default_value = "randread,randwrite,read,write"
    )]
    pub patterns: Vec<Pattern>,

    /// Queue depths per connection, comma-separated (1 to 1024).
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        default_value = "1,32",
        value_parser = clap::value_parser!(u32).range(1..=1024)
    )]
    pub iodepths: Vec<u32>,

    /// NBD connections (fio jobs), each on its own slice of the region.
    #[arg(long, value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub jobs: u32,

    /// Seconds per cell.
    #[arg(long, value_name = "SECONDS", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(1..=86400))]
    pub runtime: u64,

    /// Size of the region measured, from offset 0 [default: the whole export, at most 2G].
    #[arg(long, value_name = "SIZE", value_parser = parse_size_arg, allow_hyphen_values = true)]
    pub size: Option<u64>,

    /// Skip the sequential fill pass (only when the region is already written).
    #[arg(long)]
    pub no_fill: bool,

    /// Flush after every N writes in write cells (fio --fsync=N: an NBD FLUSH each time);
    /// 0: no flushes during cells.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub fsync: u32,

    /// Overwrite a volume or export that holds data (or is in use, or cannot be checked).
    #[arg(long)]
    pub force: bool,

    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

fn parse_bench_block_size(s: &str) -> Result<u64, String> {
    let bytes = parse_size_arg(s)?;
    if bytes == 0 || bytes % 512 != 0 || bytes > BENCH_BLOCK_BYTES_MAX {
        return Err(format!(
            "invalid block size '{s}': must be a multiple of 512 up to {}",
            bulwark_engine::size::format_size(BENCH_BLOCK_BYTES_MAX)
        ));
    }
    Ok(bytes)
}

/// NBD servers need not accept requests above 32 MiB.
const BENCH_BLOCK_BYTES_MAX: u64 = 32 << 20;

fn parse_fault_mode(s: &str) -> Result<FaultMode, String> {
    s.parse::<FaultMode>().map_err(|e| e.to_string())
}

fn parse_probability(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(p) if (0.0..=1.0).contains(&p) => Ok(p),
        _ => Err(format!(
            "invalid probability '{s}': use a number from 0 to 1"
        )),
    }
}

/// A rate in bytes per second: a size, with an optional "/s".
fn parse_rate_arg(s: &str) -> Result<u64, String> {
    let bytes = parse_size_arg(s.strip_suffix("/s").unwrap_or(s))?;
    if bytes == 0 {
        return Err(format!("invalid rate '{s}': must be more than 0"));
    }
    Ok(bytes)
}

fn parse_layout(s: &str) -> Result<Layout, String> {
    s.parse::<Layout>().map_err(|e| e.to_string())
}

fn parse_size_arg(s: &str) -> Result<u64, String> {
    bulwark_engine::size::parse_size(s).map_err(|e| e.to_string())
}

fn parse_block_size(s: &str) -> Result<u32, String> {
    let bytes = parse_size_arg(s)?;
    let ok = bytes.is_power_of_two()
        && (BLOCK_BYTES_MIN as u64..=BLOCK_BYTES_MAX as u64).contains(&bytes);
    if !ok {
        return Err(format!(
            "invalid block size '{s}': must be a power of two from {} to {}",
            bulwark_engine::size::format_size(BLOCK_BYTES_MIN as u64),
            bulwark_engine::size::format_size(BLOCK_BYTES_MAX as u64),
        ));
    }
    Ok(bytes as u32)
}

/// Block sizes a volume may use (the engine checks them again).
const BLOCK_BYTES_MIN: u32 = 4 << 10;
const BLOCK_BYTES_MAX: u32 = 128 << 10;

#[cfg(test)]
mod tests {
    use super::*;

    /// Completions and man pages come from the same definitions as the parser: every
    /// command is in them.
    #[test]
    fn completions_and_man_pages_cover_every_command() {
        let bash = String::from_utf8(completions(clap_complete::Shell::Bash)).unwrap();
        for word in ["volume", "history", "scrub", "--passphrase-file"] {
            assert!(bash.contains(word), "bash completion lacks {word}");
        }
        let dir = tempfile::tempdir().unwrap();
        let pages = man_pages(dir.path()).unwrap();
        let names: Vec<String> = pages
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        for want in [
            "bulwark.1",
            "bulwark-volume-create.1",
            "bulwark-key-load.1",
            "bulwark-history.1",
        ] {
            assert!(names.iter().any(|n| n == want), "no {want} in {names:?}");
        }
        let page = std::fs::read_to_string(dir.path().join("bulwark-volume-create.1")).unwrap();
        assert!(
            page.contains("bulwark volume create") && page.contains("size"),
            "{page}"
        );
    }
    use clap::CommandFactory;

    /// `--pool` is shown only where it names the running daemon; `pool
    /// create` and `serve` still accept it (hidden) for old scripts.
    #[test]
    fn pool_option_shown_only_where_it_means_the_daemon() {
        let mut cli = Cli::command();
        cli.build();
        let pool_hidden = |path: &[&str]| {
            let mut cmd = &cli;
            for name in path {
                cmd = cmd.find_subcommand(name).unwrap();
            }
            let arg = cmd.get_arguments().find(|a| a.get_id() == "pool").unwrap();
            arg.is_hide_set()
        };
        assert!(pool_hidden(&["serve"]));
        assert!(pool_hidden(&["pool"]));
        assert!(pool_hidden(&["pool", "create"]));
        for shown in [
            &["status"][..],
            &["volume", "list"],
            &["key", "load"],
            &["scrub"],
        ] {
            assert!(!pool_hidden(shown), "{shown:?}");
        }

        let parse = |args: &[&str]| Cli::try_parse_from(args).unwrap();
        let cli = parse(&["bulwark", "serve", "--pool", "/p"]);
        assert_eq!(cli.pool.as_deref(), Some(std::path::Path::new("/p")));
        let cli = parse(&["bulwark", "--pool", "/p", "serve"]);
        assert_eq!(cli.pool.as_deref(), Some(std::path::Path::new("/p")));
        let cli = parse(&[
            "bulwark",
            "pool",
            "create",
            "/d",
            "--device-size",
            "1G",
            "--pool",
            "/p",
        ]);
        assert!(
            matches!(cli.command, Command::Pool(PoolCommand::Create(ref a)) if a.dir == std::path::Path::new("/d"))
        );
        let cli = parse(&["bulwark", "status", "--pool", "/q"]);
        assert_eq!(cli.pool.as_deref(), Some(std::path::Path::new("/q")));
    }

    fn parse(args: &[&str]) -> std::result::Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("bulwark").chain(args.iter().copied()))
    }

    #[test]
    fn clap_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn volume_create_defaults() {
        let cli = parse(&["volume", "create", "v", "--size", "1G", "--key-file", "/k"]).unwrap();
        let Command::Volume(VolumeCommand::Create(a)) = cli.command else {
            panic!()
        };
        assert_eq!(a.size, 1 << 30);
        assert_eq!(a.settings.block_size, 4096);
        assert_eq!(a.settings.compression, CompressionArg::Lz4);
        assert_eq!(a.settings.encryption, OnOff::On);
        assert_eq!(
            a.settings.secret_for_encryption().unwrap().unwrap().kind,
            SecretKind::Key
        );
    }

    #[test]
    fn encryption_needs_exactly_one_key() {
        let cli = parse(&["volume", "create", "v", "--size", "1G"]).unwrap();
        let Command::Volume(VolumeCommand::Create(a)) = cli.command else {
            panic!()
        };
        assert!(a.settings.secret_for_encryption().is_err());

        let cli = parse(&[
            "volume",
            "create",
            "v",
            "--size",
            "1G",
            "--encryption",
            "off",
            "--key-file",
            "/k",
        ])
        .unwrap();
        let Command::Volume(VolumeCommand::Create(a)) = cli.command else {
            panic!()
        };
        assert!(a.settings.secret_for_encryption().is_err());

        let cli = parse(&[
            "volume",
            "create",
            "v",
            "--size",
            "1G",
            "--encryption",
            "off",
        ])
        .unwrap();
        let Command::Volume(VolumeCommand::Create(a)) = cli.command else {
            panic!()
        };
        assert!(a.settings.secret_for_encryption().unwrap().is_none());

        assert!(parse(&[
            "volume",
            "create",
            "v",
            "--size",
            "1G",
            "--key-file",
            "/k",
            "--passphrase-file",
            "/p"
        ])
        .is_err());
    }

    #[test]
    fn image_forms() {
        let cli = parse(&["image", "import", "d.qcow2", "vm1", "--key-file", "/k"]).unwrap();
        let Command::Image(ImageCommand::Import(a)) = cli.command else {
            panic!()
        };
        assert_eq!((a.file.to_str(), a.name.as_str()), (Some("d.qcow2"), "vm1"));
        assert_eq!(a.format, None);
        assert_eq!(a.settings.block_size, 4096);
        assert_eq!(
            a.settings.secret_for_encryption().unwrap().unwrap().kind,
            SecretKind::Key
        );
        let cli = parse(&[
            "image",
            "import",
            "d.img",
            "vm1",
            "--format",
            "raw",
            "--encryption",
            "off",
            "--block-size",
            "64K",
            "--compression",
            "off",
        ])
        .unwrap();
        let Command::Image(ImageCommand::Import(a)) = cli.command else {
            panic!()
        };
        assert_eq!(a.format, Some(ImageFormat::Raw));
        assert_eq!(a.settings.block_size, 65536);
        assert!(a.settings.secret_for_encryption().unwrap().is_none());
        let cli = parse(&["image", "import", "d.img", "vm1"]).unwrap();
        let Command::Image(ImageCommand::Import(a)) = cli.command else {
            panic!()
        };
        assert!(a.settings.secret_for_encryption().is_err());
        assert!(parse(&["image", "import", "d.img", "vm1", "--format", "vmdk"]).is_err());
        assert!(parse(&["image", "import", "d.img"]).is_err());

        let cli = parse(&["image", "export", "vm1@image", "out.img"]).unwrap();
        let Command::Image(ImageCommand::Export(a)) = cli.command else {
            panic!()
        };
        assert_eq!(
            (a.source.as_str(), a.format, a.force),
            ("vm1@image", ImageFormat::Raw, false)
        );
        let cli = parse(&[
            "image", "export", "vm1", "o", "--format", "qcow2", "--force",
        ])
        .unwrap();
        let Command::Image(ImageCommand::Export(a)) = cli.command else {
            panic!()
        };
        assert_eq!((a.format, a.force), (ImageFormat::Qcow2, true));
        assert!(parse(&["image", "list", "--json"]).is_ok());
    }

    #[test]
    fn block_size_is_checked() {
        for bad in ["2K", "256K", "5K", "x"] {
            assert!(
                parse(&["volume", "create", "v", "--size", "1G", "--block-size", bad]).is_err(),
                "{bad}"
            );
        }
        for good in ["4K", "64K", "128K", "8192"] {
            assert!(
                parse(&[
                    "volume",
                    "create",
                    "v",
                    "--size",
                    "1G",
                    "--block-size",
                    good
                ])
                .is_ok(),
                "{good}"
            );
        }
    }

    #[test]
    fn pool_create_sources() {
        assert!(parse(&[
            "pool",
            "create",
            "/p",
            "--layout",
            "single",
            "--devices",
            "1",
            "--device-size",
            "256M"
        ])
        .is_ok());
        assert!(parse(&[
            "pool", "create", "/p", "--layout", "mirror:2", "--device", "/a", "--device", "/b"
        ])
        .is_ok());
        assert!(parse(&["pool", "create", "/p", "--layout", "single"]).is_err());
        assert!(parse(&[
            "pool",
            "create",
            "/p",
            "--device-size",
            "1G",
            "--device",
            "/a"
        ])
        .is_err());
        assert!(parse(&["pool", "create", "/p", "--devices", "2", "--device", "/a"]).is_err());
        assert!(parse(&[
            "pool",
            "create",
            "/p",
            "--layout",
            "mirror:1",
            "--device-size",
            "1G"
        ])
        .is_err());
    }

    #[test]
    fn bench_defaults_and_lists() {
        let cli = parse(&["bench", "v"]).unwrap();
        let Command::Bench(a) = cli.command else {
            panic!()
        };
        assert_eq!(a.volume.as_deref(), Some("v"));
        assert_eq!(a.block_sizes, vec![4096, 65536, 1 << 20]);
        assert_eq!(
            a.patterns,
            vec![
                Pattern::Randread,
                Pattern::Randwrite,
                Pattern::Read,
                Pattern::Write
            ]
        );
        assert_eq!(a.iodepths, vec![1, 32]);
        assert_eq!((a.jobs, a.runtime, a.size, a.fsync), (1, 10, None, 0));
        assert!(!a.force && !a.json && !a.no_fill);

        let cli = parse(&[
            "bench",
            "--uri",
            "nbd://h/x",
            "--block-sizes",
            "4k,1M",
            "--patterns",
            "randread,write",
            "--iodepths",
            "8",
            "--jobs",
            "2",
            "--size",
            "1G",
            "--fsync",
            "32",
        ])
        .unwrap();
        let Command::Bench(a) = cli.command else {
            panic!()
        };
        assert_eq!(a.uri.as_deref(), Some("nbd://h/x"));
        assert_eq!(a.fsync, 32);
        assert_eq!(a.block_sizes, vec![4096, 1 << 20]);
        assert_eq!(a.patterns, vec![Pattern::Randread, Pattern::Write]);
        assert_eq!((a.iodepths, a.jobs, a.size), (vec![8], 2, Some(1 << 30)));
    }

    #[test]
    fn bench_rejects_bad_arguments() {
        assert!(parse(&["bench"]).is_err(), "a target is required");
        assert!(parse(&["bench", "v", "--uri", "nbd://h/x"]).is_err());
        for bad in [
            ["--block-sizes", "1000"],
            ["--block-sizes", "64M"],
            ["--patterns", "trim"],
            ["--iodepths", "0"],
            ["--jobs", "0"],
            ["--runtime", "0"],
        ] {
            assert!(parse(&["bench", "v", bad[0], bad[1]]).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn scrub_forms() {
        let cli = parse(&["scrub", "--wait"]).unwrap();
        let Command::Scrub(a) = cli.command else {
            panic!()
        };
        assert!(a.wait && a.command.is_none());
        let cli = parse(&["scrub", "start", "--wait"]).unwrap();
        let Command::Scrub(a) = cli.command else {
            panic!()
        };
        assert!(matches!(
            a.command,
            Some(ScrubCommand::Start(ScrubStartArgs {
                wait: true,
                verify_store: false
            }))
        ));
        let cli = parse(&["scrub", "start", "--verify-store"]).unwrap();
        let Command::Scrub(a) = cli.command else {
            panic!()
        };
        assert!(matches!(
            a.command,
            Some(ScrubCommand::Start(ScrubStartArgs {
                verify_store: true,
                ..
            }))
        ));
        for ok in [
            &["scrub"][..],
            &["scrub", "pause"],
            &["scrub", "resume"],
            &["scrub", "cancel"],
            &["scrub", "status", "--json"],
        ] {
            assert!(parse(ok).is_ok(), "{ok:?}");
        }
        assert!(parse(&["scrub", "--wait", "pause"]).is_err());
        assert!(parse(&["scrub", "pause", "--wait"]).is_err());
    }

    #[test]
    fn fault_set_checks_mode_and_probability() {
        let cli = parse(&["fault", "set", "/d", "read-flip", "--probability", "0.5"]).unwrap();
        let Command::Fault(FaultCommand::Set(a)) = cli.command else {
            panic!()
        };
        assert_eq!(
            (a.mode, a.probability, a.seed),
            (FaultMode::ReadFlip, 0.5, None)
        );
        let cli = parse(&["fault", "set", "/d", "slow-reads"]).unwrap();
        let Command::Fault(FaultCommand::Set(a)) = cli.command else {
            panic!()
        };
        assert_eq!(a.mode, FaultMode::SlowReads);
        assert!(parse(&["fault", "set", "/d", "flip-everything"]).is_err());
        assert!(parse(&["fault", "set", "/d", "vanish", "--probability", "2"]).is_err());
        assert!(parse(&["fault", "clear"]).is_ok());
        assert!(parse(&["fault", "list", "--json"]).is_ok());
    }

    #[test]
    fn serve_fault_injection_and_scrub_rate() {
        let cli = parse(&[
            "serve",
            "/p",
            "--allow-fault-injection",
            "--scrub-rate",
            "1M",
        ])
        .unwrap();
        let Command::Serve(a) = cli.command else {
            panic!()
        };
        assert!(a.allow_fault_injection);
        assert_eq!(a.scrub_rate, Some(1 << 20));
        assert!(parse(&["serve", "/p", "--scrub-rate", "0"]).is_err());
        let cli = parse(&["serve", "/p"]).unwrap();
        let Command::Serve(a) = cli.command else {
            panic!()
        };
        assert!(!a.allow_fault_injection && a.scrub_rate.is_none());
        assert!(a.nbd_threads.is_none());
        let Command::Serve(a) = parse(&["serve", "/p", "--nbd-threads", "8"])
            .unwrap()
            .command
        else {
            panic!()
        };
        assert_eq!(a.nbd_threads, Some(8));
        assert!(parse(&["serve", "/p", "--nbd-threads", "0"]).is_err());
        assert!(parse(&["serve", "/p", "--nbd-threads", "257"]).is_err());
        let Command::Serve(a) = parse(&[
            "serve",
            "/p",
            "--max-startups",
            "64",
            "--max-startups-per-address",
            "4",
            "--tls-timeout",
            "2",
            "--payload-timeout",
            "3",
        ])
        .unwrap()
        .command
        else {
            panic!()
        };
        assert_eq!(
            (
                a.max_startups,
                a.max_startups_per_address,
                a.tls_timeout,
                a.payload_timeout
            ),
            (Some(64), Some(4), Some(2), Some(3))
        );
        assert!(parse(&["serve", "/p", "--tls-timeout", "0"]).is_err());
        assert!(parse(&["serve", "/p", "--payload-timeout", "0"]).is_err());
    }

    #[test]
    fn key_load_needs_a_file() {
        assert!(parse(&["key", "load", "v"]).is_err());
        assert!(parse(&["key", "load", "v", "--passphrase-file", "/p"]).is_ok());
    }

    #[test]
    fn key_lifecycle_forms() {
        for ok in [
            &["key", "add", "v", "--passphrase-file", "/p"][..],
            &["key", "remove", "v", "--key-file", "/k"],
            &["key", "list", "v", "--json"],
            &["key", "rotate", "v", "--wait"],
            &["key", "erase", "v", "--yes"],
            &[
                "key",
                "change",
                "v",
                "--key-file",
                "/k",
                "--new-passphrase-file",
                "/p",
            ],
            &["volume", "destroy", "v", "--crypto-erase"],
        ] {
            assert!(parse(ok).is_ok(), "{ok:?}");
        }
        for bad in [
            &["key", "add", "v"][..],
            &[
                "key",
                "add",
                "v",
                "--key-file",
                "/k",
                "--passphrase-file",
                "/p",
            ],
            &["key", "change", "v", "--key-file", "/k"],
            &["key", "change", "v", "--new-key-file", "/k"],
            &[
                "key",
                "change",
                "v",
                "--key-file",
                "/k",
                "--new-key-file",
                "/a",
                "--new-passphrase-file",
                "/b",
            ],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
        let cli = parse(&[
            "key",
            "change",
            "v",
            "--passphrase-file",
            "/o",
            "--new-key-file",
            "/n",
        ])
        .unwrap();
        let Command::Key(KeyCommand::Change(a)) = cli.command else {
            panic!()
        };
        assert_eq!(a.old.file().unwrap().kind, SecretKind::Passphrase);
        let new = a.new_secret().unwrap();
        assert_eq!((new.kind, new.path), (SecretKind::Key, PathBuf::from("/n")));
    }
}
