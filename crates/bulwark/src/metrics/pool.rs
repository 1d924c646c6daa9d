//! The pool as a scrape sees it: one `Pool::status()` per scrape (what
//! `bulwark status --json` shows, read under the same locks and no others),
//! plus the snapshot count per volume (`Pool::snapshot_counts`, which walks no
//! tree) and the NBD server's open connections.
//!
//! Numbers the engine keeps since the daemon started (device errors, repaired
//! blocks, bytes written) are counters; everything else is a gauge. A state is
//! one series per possible value, 1 for the current one and 0 for the others
//! (so `bulwark_device_state{state="FAULTED"} == 1` is an alert rule).

use std::sync::Arc;

use bulwark_engine::{Pool, PoolStatus};
use bulwark_nbd::Server;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeCounterValue, EncodeGaugeValue, EncodeLabelSet, EncodeMetric,
};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

/// States `Pool::status` gives a pool.
const POOL_STATES: [&str; 3] = ["ONLINE", "DEGRADED", "FAULTED"];
/// States it gives a device.
const DEVICE_STATES: [&str; 5] = ["ONLINE", "RESILVERING", "OFFLINE", "UNAVAIL", "FAULTED"];
/// States of the separate intent log (`status`'s `logs:`).
const LOG_STATES: [&str; 3] = ["ONLINE", "DEGRADED", "FELL_BACK"];
/// Phases of a scrub or resilver.
const SCRUB_STATES: [&str; 6] = [
    "none",
    "scanning",
    "paused",
    "finished",
    "canceled",
    "restarting",
];
/// Kinds of unreadable ranges in the pool's error list.
const DATA_ERROR_KINDS: [&str; 2] = ["data", "map"];

pub(super) struct PoolCollector {
    pool: Arc<Pool>,
    server: Arc<Server>,
}

impl std::fmt::Debug for PoolCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolCollector").finish_non_exhaustive()
    }
}

impl PoolCollector {
    pub(super) fn new(pool: Arc<Pool>, server: Arc<Server>) -> PoolCollector {
        PoolCollector { pool, server }
    }
}

impl Collector for PoolCollector {
    fn encode(&self, mut e: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let st = self.pool.status();
        let snapshots = self.pool.snapshot_counts();
        encode_status(&mut e, &st, &snapshots)?;
        gauge(
            &mut e,
            "nbd_connections",
            "Open NBD connections, in any phase (handshake included)",
            self.server.connections() as u64,
        )
    }
}

/// One label-free gauge.
fn gauge(
    e: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    v: impl EncodeGaugeValue,
) -> Result<(), std::fmt::Error> {
    let m = e.encode_descriptor(name, help, None, MetricType::Gauge)?;
    ConstGauge::new(v).encode(m)
}

/// One label-free counter.
fn counter(
    e: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    v: impl EncodeCounterValue,
) -> Result<(), std::fmt::Error> {
    let m = e.encode_descriptor(name, help, None, MetricType::Counter)?;
    ConstCounter::new(v).encode(m)
}

/// A gauge family, one series per row; nothing at all without rows.
fn gauges<L: EncodeLabelSet, V: EncodeGaugeValue>(
    e: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: impl IntoIterator<Item = (L, V)>,
) -> Result<(), std::fmt::Error> {
    let mut rows = rows.into_iter().peekable();
    if rows.peek().is_none() {
        return Ok(());
    }
    let mut m = e.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, v) in rows {
        ConstGauge::new(v).encode(m.encode_family(&labels)?)?;
    }
    Ok(())
}

/// A counter family, one series per row; nothing at all without rows.
fn counters<L: EncodeLabelSet, V: EncodeCounterValue>(
    e: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: impl IntoIterator<Item = (L, V)>,
) -> Result<(), std::fmt::Error> {
    let mut rows = rows.into_iter().peekable();
    if rows.peek().is_none() {
        return Ok(());
    }
    let mut m = e.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, v) in rows {
        ConstCounter::new(v).encode(m.encode_family(&labels)?)?;
    }
    Ok(())
}

/// 1 for the state `now` is, 0 for the others in `all`; a state not in `all`
/// gets a series of its own (the engine learned a new one), so none is lost.
/// The object store's states (`TierStatus::state`).
const STORE_STATES: [&str; 4] = ["HELD", "FAILING", "UNREACHABLE", "FENCED"];

fn states<'a>(all: &[&'a str], now: &'a str) -> Vec<(&'a str, u64)> {
    let mut out: Vec<(&str, u64)> = all.iter().map(|s| (*s, u64::from(*s == now))).collect();
    if !all.contains(&now) {
        out.push((now, 1));
    }
    out
}

pub(super) fn encode_status(
    e: &mut DescriptorEncoder,
    st: &PoolStatus,
    snapshots: &[(String, usize)],
) -> Result<(), std::fmt::Error> {
    // The pool.
    gauges(
        e,
        "pool_info",
        "Always 1; labels name the pool and its layout",
        [(
            [
                ("pool_id", st.pool_id.as_str()),
                ("layout", st.layout.as_str()),
            ],
            1u64,
        )],
    )?;
    gauges(
        e,
        "pool_state",
        "1 for the pool's state (ONLINE, DEGRADED, FAULTED), 0 for the others",
        states(&POOL_STATES, &st.state)
            .into_iter()
            .map(|(s, v)| ([("state", s)], v)),
    )?;
    gauge(
        e,
        "pool_generation",
        "Superblock generation of the last durable commit",
        st.generation,
    )?;
    counter(
        e,
        "pool_repaired_blocks",
        "Bad copies rewritten from a verified copy since the daemon started (reads and scrubs)",
        st.repaired_blocks,
    )?;
    counter(
        e,
        "pool_unrecoverable_blocks",
        "Reads with no good copy since the daemon started (the client got EIO)",
        st.unrecoverable_blocks,
    )?;
    gauges(
        e,
        "pool_data_errors",
        "Ranges in the pool's error list (no copy could supply them), by what they held",
        DATA_ERROR_KINDS.iter().map(|kind| {
            let n = st
                .errors
                .iter()
                .filter(|x| x.kind.to_string() == *kind)
                .count() as u64;
            ([("kind", *kind)], n)
        }),
    )?;

    // Space, as `status` shows it (usable bytes: after redundancy).
    let s = &st.space;
    let space = [
        ("total", s.total_bytes, "all segments"),
        ("used", s.used_bytes, "live data and metadata"),
        ("free", s.free_bytes, "what client writes may still take"),
        (
            "reserved",
            s.reserved_bytes,
            "kept back from client writes for commits and the cleaner",
        ),
        (
            "usable",
            s.usable_bytes,
            "what live data may fill (overwrites never fail for space below it)",
        ),
        (
            "provisioned",
            s.provisioned_bytes,
            "sum of the volumes' sizes (above usable: thin)",
        ),
    ];
    for (what, v, help) in space {
        gauge(
            e,
            &format!("pool_space_{what}_bytes"),
            &format!("Pool space, bytes: {help}"),
            v,
        )?;
    }
    counters(
        e,
        "pool_written_bytes",
        "Bytes written since the daemon started, by stream: client data, blocks the \
         cleaner moved, metadata (map nodes, volume table)",
        [
            ("data", s.data_written_bytes),
            ("cleaner", s.clean_written_bytes),
            ("metadata", s.meta_written_bytes),
        ]
        .map(|(stream, v)| ([("stream", stream)], v)),
    )?;
    gauge(
        e,
        "pool_write_amplification",
        "(data + cleaner + metadata) / data bytes written since the daemon started",
        s.write_amplification,
    )?;

    // The cache device, when one is configured.
    if let Some(c) = &st.cache_device {
        gauge(
            e,
            "cache_device_size_bytes",
            "Bytes of the cache device's ring",
            c.size_bytes,
        )?;
        gauge(
            e,
            "cache_device_used_bytes",
            "Bytes of the cache device's ring its entries take",
            c.used_bytes,
        )?;
        counter(
            e,
            "cache_device_hits",
            "Reads of a record served by the cache device since the daemon started",
            c.hits,
        )?;
        counter(
            e,
            "cache_device_misses",
            "Reads of a record the cache device did not serve since the daemon started",
            c.misses,
        )?;
        counter(
            e,
            "cache_device_errors",
            "Cache device copies that failed their checksum (dropped; read from the pool)",
            c.errors,
        )?;
    }

    // The object store, when the pool has one (docs/object-store.md).
    if let Some(t) = &st.object_store {
        let r = &t.requests;
        counters(
            e,
            "object_store_requests",
            "Requests made to the object store since the daemon started, by kind",
            [
                ([("kind", "put")], r.puts),
                ([("kind", "get")], r.gets),
                ([("kind", "delete")], r.deletes),
                ([("kind", "list")], r.lists),
            ],
        )?;
        counters(
            e,
            "object_store_bytes",
            "Bytes sent to (up) and received from (down) the object store since the daemon started",
            [
                ([("direction", "up")], r.bytes_up),
                ([("direction", "down")], r.bytes_down),
            ],
        )?;
        counter(
            e,
            "object_store_collected",
            "Objects no commit referenced, deleted from the object store since the daemon started",
            t.collected,
        )?;
        gauge(
            e,
            "object_store_fenced",
            "1 once another host took the pool in its object store (this daemon stopped writing)",
            u64::from(t.fenced.is_some()),
        )?;
        gauges(
            e,
            "object_store_state",
            "1 for the object store's state: HELD, FAILING (commits do not reach it), UNREACHABLE (not answering since the pool was imported; commits stay local), FENCED",
            states(&STORE_STATES, if t.state.is_empty() { "HELD" } else { &t.state })
                .into_iter()
                .map(|(s, v)| ([("state", s)], v)),
        )?;
        counters(
            e,
            "object_store_commits",
            "Commits since the daemon started, by result: ok (reached the store), failed (did not; the next one retries)",
            [
                ([("result", "ok")], t.commits_ok),
                ([("result", "failed")], t.commits_failed),
            ],
        )?;
        counters(
            e,
            "object_store_request_errors",
            "Object store requests that failed since the daemon started, by the cause the server gave (timeout, connect, no_such_bucket, access_denied, signature_does_not_match, ...)",
            bulwark_objstore::CAUSE_KINDS.iter().map(|k| {
                (
                    [("kind", *k)],
                    t.request_errors.get(*k).copied().unwrap_or(0),
                )
            }),
        )?;
        gauge(
            e,
            "object_store_lag_bytes",
            "Bytes written locally that the object store does not hold yet",
            t.lag_bytes,
        )?;
        gauge(
            e,
            "object_store_lag_seconds",
            "Seconds since the last commit that reached the object store, while it lacks writes (0 when it lacks none)",
            t.lag_seconds,
        )?;
        if let Some(at) = t.last_commit {
            gauge(
                e,
                "object_store_last_commit_timestamp_seconds",
                "When a commit last reached the object store (Unix time)",
                at,
            )?;
        }
        gauge(
            e,
            "object_store_epoch",
            "The writer epoch this daemon holds the pool's object store under",
            t.epoch,
        )?;
        counter(
            e,
            "object_store_remote_reads",
            "Reads the object store served since the daemon started (records of segments the local cache gave back, and records no local copy verified)",
            t.remote_reads,
        )?;
        counter(
            e,
            "object_store_remote_read_bytes",
            "Bytes fetched from the object store for those reads (read-ahead included)",
            t.remote_read_bytes,
        )?;
        counter(
            e,
            "object_store_read_ahead_hits",
            "Reads of given-back records served from bytes read ahead of a sequential read (no request of their own)",
            t.read_ahead_hits,
        )?;
        counter(
            e,
            "object_store_healed",
            "Records no local copy verified, read from the object store instead, since the daemon started",
            t.healed_from_store,
        )?;
        if let Some(c) = &t.cache {
            gauge(
                e,
                "object_store_cache_limit_bytes",
                "What the local devices may take before segments the store holds are given back",
                c.limit_bytes,
            )?;
            gauge(
                e,
                "object_store_cache_local_bytes",
                "What the local devices take (allocated blocks of the device files)",
                c.local_bytes,
            )?;
            gauge(
                e,
                "object_store_cache_evicted_segments",
                "Segments of client data only the object store holds",
                c.evicted_segments,
            )?;
            counter(
                e,
                "object_store_cache_brought_back",
                "Given-back segments brought back whole since the daemon started (read from the store often)",
                c.refilled_total,
            )?;
            counter(
                e,
                "object_store_cache_paced_writes",
                "Client writes that waited for the store to take room back (the cache past its size)",
                c.paced_writes,
            )?;
        }
    }

    // Devices.
    let devices: Vec<(String, &bulwark_engine::DeviceStatus)> = st
        .devices
        .iter()
        .map(|d| (d.path.display().to_string(), d))
        .collect();
    let by_device = |f: fn(&bulwark_engine::DeviceStatus) -> u64| {
        devices
            .iter()
            .map(move |(path, d)| ([("device", path.as_str())], f(d)))
    };
    counters(
        e,
        "device_read_errors",
        "Reads that failed on the device since the daemon started",
        by_device(|d| d.read_errors),
    )?;
    counters(
        e,
        "device_write_errors",
        "Writes (and flushes) that failed on the device since the daemon started",
        by_device(|d| d.write_errors),
    )?;
    counters(
        e,
        "device_checksum_errors",
        "Copies read from the device that failed their checksum since the daemon started",
        by_device(|d| d.cksum_errors),
    )?;
    gauges(
        e,
        "device_size_bytes",
        "Size of the device",
        by_device(|d| d.size_bytes),
    )?;
    gauges(
        e,
        "device_state",
        "1 for the device's state (ONLINE, RESILVERING, OFFLINE, UNAVAIL, FAULTED), 0 for the others",
        devices.iter().flat_map(|(path, d)| {
            states(&DEVICE_STATES, &d.state)
                .into_iter()
                .map(move |(s, v)| ([("device", path.as_str()), ("state", s)], v))
        }),
    )?;

    // Separate intent log devices, when the pool has any.
    if let Some(log) = &st.log {
        gauges(
            e,
            "log_state",
            "1 for the state of the pool's separate intent log (ONLINE, DEGRADED, FELL_BACK), 0 for the others",
            states(&LOG_STATES, &log.state)
                .into_iter()
                .map(|(s, v)| ([("state", s)], v)),
        )?;
        let logs: Vec<(String, &bulwark_engine::pool::DeviceStatus)> = log
            .devices
            .iter()
            .map(|d| (d.path.display().to_string(), d))
            .collect();
        gauges(
            e,
            "log_device_state",
            "1 for the log device's state (ONLINE, FAULTED, UNAVAIL), 0 for the others",
            logs.iter().flat_map(|(path, d)| {
                states(&["ONLINE", "FAULTED", "UNAVAIL"], &d.state)
                    .into_iter()
                    .map(move |(s, v)| ([("device", path.as_str()), ("state", s)], v))
            }),
        )?;
    }

    // Scrub or resilver.
    let sc = &st.scrub;
    let phase = if sc.state.is_empty() {
        "none"
    } else {
        &sc.state
    };
    gauges(
        e,
        "scrub_state",
        "1 for the scrub's (or resilver's) phase, 0 for the others",
        states(&SCRUB_STATES, phase)
            .into_iter()
            .map(|(s, v)| ([("state", s)], v)),
    )?;
    gauge(
        e,
        "scrub_resilvering",
        "1 when the current or last pass is a resilver, 0 for a scrub",
        u64::from(sc.kind == "resilver"),
    )?;
    gauge(
        e,
        "scrub_done_bytes",
        "Bytes the current or last pass has examined",
        sc.bytes_done,
    )?;
    gauge(
        e,
        "scrub_planned_bytes",
        "Bytes the current or last pass has to examine",
        sc.bytes_total,
    )?;
    gauge(
        e,
        "scrub_rate_bytes_per_second",
        "Rate of the running pass",
        sc.rate_bytes_per_sec,
    )?;
    gauge(
        e,
        "scrub_repaired_blocks",
        "Copies the current or last pass repaired",
        sc.repaired,
    )?;
    gauge(
        e,
        "scrub_unrecoverable_blocks",
        "Records the current or last pass found with no good copy",
        sc.unrecoverable,
    )?;

    // Volumes.
    let volumes = &st.volumes;
    gauges(
        e,
        "volume_size_bytes",
        "Size of the volume as clients see it",
        volumes
            .iter()
            .map(|v| ([("volume", v.name.as_str())], v.size_bytes)),
    )?;
    gauges(
        e,
        "volume_used_bytes",
        "Stored bytes the volume references (after compression, one copy)",
        volumes
            .iter()
            .map(|v| ([("volume", v.name.as_str())], v.used_bytes)),
    )?;
    gauges(
        e,
        "volume_locked",
        "1 while the volume's key is not loaded (it is not exported)",
        volumes
            .iter()
            .map(|v| ([("volume", v.name.as_str())], u64::from(v.locked))),
    )?;
    gauges(
        e,
        "volume_key_generation",
        "Data key generation new writes use (encrypted volumes)",
        volumes
            .iter()
            .filter(|v| v.encryption)
            .map(|v| ([("volume", v.name.as_str())], u64::from(v.key_generation))),
    )?;
    gauges(
        e,
        "volume_snapshots",
        "Snapshots of the volume",
        snapshots
            .iter()
            .map(|(name, n)| ([("volume", name.as_str())], *n as u64)),
    )?;
    let rotating = || {
        volumes
            .iter()
            .filter_map(|v| Some((v, v.rotation.as_ref()?)))
    };
    gauges(
        e,
        "volume_key_rotation_done_blocks",
        "Blocks the key rotation in progress has examined",
        rotating().map(|(v, r)| ([("volume", v.name.as_str())], r.blocks_done)),
    )?;
    gauges(
        e,
        "volume_key_rotation_planned_blocks",
        "Blocks the key rotation in progress has to examine",
        rotating().map(|(v, r)| ([("volume", v.name.as_str())], r.blocks_total)),
    )?;
    gauges(
        e,
        "volume_key_rotation_paused",
        "1 while the key rotation in progress is paused by an error (see `bulwark status`)",
        rotating().map(|(v, r)| ([("volume", v.name.as_str())], u64::from(r.error.is_some()))),
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use bulwark_engine::{DeviceStatus, SpaceStatus};
    use prometheus_client::registry::Registry;

    #[derive(Debug)]
    struct Fixed(PoolStatus, Vec<(String, usize)>);

    impl Collector for Fixed {
        fn encode(&self, mut e: DescriptorEncoder) -> Result<(), std::fmt::Error> {
            encode_status(&mut e, &self.0, &self.1)
        }
    }

    #[test]
    fn status_becomes_series() {
        let st = PoolStatus {
            pool_id: "ab12".into(),
            state: "DEGRADED".into(),
            layout: "mirror:2".into(),
            generation: 42,
            devices: vec![
                DeviceStatus {
                    path: "/p/dev0.img".into(),
                    state: "ONLINE".into(),
                    cksum_errors: 3,
                    size_bytes: 1 << 30,
                    ..Default::default()
                },
                DeviceStatus {
                    path: "/p/dev1.img".into(),
                    state: "FAULTED".into(),
                    write_errors: 1,
                    size_bytes: 1 << 30,
                    ..Default::default()
                },
            ],
            repaired_blocks: 5,
            space: SpaceStatus {
                total_bytes: 1000,
                used_bytes: 100,
                data_written_bytes: 4096,
                meta_written_bytes: 512,
                write_amplification: 1.125,
                ..Default::default()
            },
            cache_device: Some(bulwark_engine::cachedev::CacheDeviceStatus {
                size_bytes: 1 << 30,
                hits: 7,
                errors: 2,
                ..Default::default()
            }),
            object_store: Some(bulwark_engine::pool::tier::TierStatus {
                epoch: 4,
                fenced: Some("taken over".into()),
                collected: 9,
                remote_reads: 11,
                cache: Some(bulwark_engine::pool::tier::CacheStatus {
                    limit_bytes: 1 << 20,
                    evicted_segments: 6,
                    ..Default::default()
                }),
                requests: bulwark_engine::pool::tier::Requests {
                    puts: 3,
                    bytes_up: 4096,
                    ..Default::default()
                },
                ..Default::default()
            }),
            ..Default::default()
        };
        let mut r = Registry::with_prefix(crate::metrics::PREFIX);
        r.register_collector(Box::new(Fixed(st, vec![("v".into(), 2)])));
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, &r).unwrap();
        for line in [
            r#"bulwark_pool_info{pool_id="ab12",layout="mirror:2"} 1"#,
            r#"bulwark_pool_state{state="DEGRADED"} 1"#,
            r#"bulwark_pool_state{state="ONLINE"} 0"#,
            "bulwark_pool_generation 42",
            "bulwark_pool_repaired_blocks_total 5",
            "bulwark_pool_space_total_bytes 1000",
            "bulwark_pool_space_used_bytes 100",
            r#"bulwark_pool_written_bytes_total{stream="metadata"} 512"#,
            "bulwark_pool_write_amplification 1.125",
            "bulwark_cache_device_size_bytes 1073741824",
            "bulwark_cache_device_hits_total 7",
            "bulwark_cache_device_errors_total 2",
            r#"bulwark_object_store_requests_total{kind="put"} 3"#,
            r#"bulwark_object_store_bytes_total{direction="up"} 4096"#,
            "bulwark_object_store_collected_total 9",
            "bulwark_object_store_fenced 1",
            "bulwark_object_store_epoch 4",
            "bulwark_object_store_remote_reads_total 11",
            "bulwark_object_store_cache_limit_bytes 1048576",
            "bulwark_object_store_cache_evicted_segments 6",
            r#"bulwark_device_checksum_errors_total{device="/p/dev0.img"} 3"#,
            r#"bulwark_device_write_errors_total{device="/p/dev1.img"} 1"#,
            r#"bulwark_device_state{device="/p/dev1.img",state="FAULTED"} 1"#,
            r#"bulwark_device_state{device="/p/dev1.img",state="ONLINE"} 0"#,
            r#"bulwark_scrub_state{state="none"} 1"#,
            r#"bulwark_volume_snapshots{volume="v"} 2"#,
            r#"bulwark_pool_data_errors{kind="data"} 0"#,
            "# TYPE bulwark_device_checksum_errors_total counter",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in:\n{text}");
        }
        // No volume: no per-volume family at all.
        assert!(!text.contains("bulwark_volume_size_bytes"));
    }
}
