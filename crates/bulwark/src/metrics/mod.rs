//! Prometheus metrics (`serve --metrics-listen ADDR`): what the daemon counts
//! while it serves, and what it reads from the pool when it is scraped.
//!
//! Two kinds of numbers, kept apart:
//!
//! - **Counted on the I/O path** ([`Metrics`]): NBD requests per volume and
//!   operation, their bytes and failures, read and write latency, and NBD
//!   connection events. A volume's handles ([`VolumeStats`]) are looked up once,
//!   when a client opens the export, and kept by its backend, so a request
//!   costs a few relaxed atomic adds and two clock reads: no lock, no map
//!   lookup, no allocation. The latency histogram is ours ([`Latency`]), an
//!   array of atomic buckets, because the crate's takes a mutex per
//!   observation. With metrics off nothing is counted at all (the backend holds
//!   no handles).
//! - **Read at scrape time** (`pool.rs`): everything `bulwark status` shows
//!   (devices, space, write amplification, scrub, rotation, snapshots, data
//!   errors) is read from `Pool::status` on each scrape, so it can never drift
//!   from what `status` says and costs nothing between scrapes.
//!
//! The exposition format is the `prometheus-client` crate's (OpenMetrics text
//! or Prometheus text 0.0.4, whichever the scraper asks for); `http.rs` serves
//! it on a minimal HTTP/1.1 responder, loopback only unless the operator
//! allows more. Every name starts with `bulwark_`; docs/metrics.md lists them.

mod http;
mod pool;

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bulwark_engine::Pool;
use bulwark_nbd::Server;
use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;

pub use http::{bind, serve};

/// Every metric name starts with this (and `_`).
pub const PREFIX: &str = "bulwark";

/// Upper bounds of the latency buckets, in seconds: 50 µs to 1 s (and +Inf).
/// A cached 4 KiB read takes tens of µs, a FUA write to a disk a few ms, a
/// write waiting for space (back-pressure) up to seconds.
pub const LATENCY_BOUNDS_S: [f64; 14] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0,
];

/// The same bounds in nanoseconds, for the I/O path (integer compares only).
const LATENCY_BOUNDS_NS: [u64; 14] = [
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
];

const _: () = {
    let mut i = 0;
    while i < LATENCY_BOUNDS_NS.len() {
        // Both tables name the same bounds (exact: each is a whole number of µs).
        assert!(LATENCY_BOUNDS_NS[i] == (LATENCY_BOUNDS_S[i] * 1e9) as u64);
        if i > 0 {
            assert!(LATENCY_BOUNDS_NS[i - 1] < LATENCY_BOUNDS_NS[i]);
        }
        i += 1;
    }
};

/// What a client asked a volume to do, as the `op` label names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
    Trim,
    WriteZeroes,
    Flush,
    BlockStatus,
}

impl Op {
    const ALL: [Op; 6] = [
        Op::Read,
        Op::Write,
        Op::Trim,
        Op::WriteZeroes,
        Op::Flush,
        Op::BlockStatus,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::Trim => "trim",
            Op::WriteZeroes => "write_zeroes",
            Op::Flush => "flush",
            Op::BlockStatus => "block_status",
        }
    }

    /// Whether the request names a byte range (its length is counted in `volume_bytes`).
    fn has_bytes(self) -> bool {
        !matches!(self, Op::Flush | Op::BlockStatus)
    }

    /// Whether its latency is kept in a histogram.
    fn timed(self) -> bool {
        matches!(self, Op::Read | Op::Write)
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VolumeOp {
    volume: String,
    op: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ExportLabel {
    export: String,
}

/// A latency histogram that needs no lock: one atomic count per bucket and the
/// sum in whole nanoseconds. A scrape reads the buckets one by one while
/// requests go on, so it may see a request in `_count` a moment before its
/// time is in `_sum` (or the reverse): a skew of the requests of those few
/// nanoseconds, which rates over a scrape interval do not notice. `_count` is
/// the sum of the buckets read, so the two always agree.
#[derive(Debug, Clone, Default)]
pub struct Latency(Arc<LatencyCells>);

#[derive(Debug, Default)]
struct LatencyCells {
    /// Per bucket (not cumulative); the last one is +Inf.
    buckets: [AtomicU64; LATENCY_BOUNDS_NS.len() + 1],
    sum_ns: AtomicU64,
}

impl Latency {
    pub fn observe(&self, elapsed: Duration) {
        let ns = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        // The first bucket whose bound is at least `ns` (`le` is inclusive).
        let i = LATENCY_BOUNDS_NS.partition_point(|&b| b < ns);
        self.0.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.0.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }
}

impl TypedMetric for Latency {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for Latency {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let mut buckets = [(0.0, 0u64); LATENCY_BOUNDS_NS.len() + 1];
        let mut count = 0u64;
        for (i, cell) in self.0.buckets.iter().enumerate() {
            let n = cell.load(Ordering::Relaxed);
            count += n;
            let bound = LATENCY_BOUNDS_S.get(i).copied().unwrap_or(f64::INFINITY);
            buckets[i] = (bound, n);
        }
        let sum = self.0.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// One export's handles, taken when a client opens it and kept by its backend.
#[derive(Debug)]
pub struct VolumeStats {
    requests: [Counter; Op::ALL.len()],
    errors: [Counter; Op::ALL.len()],
    /// `None` for operations without a byte range.
    bytes: [Option<Counter>; Op::ALL.len()],
    /// `None` for operations whose latency is not kept.
    latency: [Option<Latency>; Op::ALL.len()],
}

impl VolumeStats {
    /// Counts one request that named `bytes` bytes and took `elapsed`. The bytes
    /// count only when it succeeded: they are bytes moved, for bandwidth.
    pub fn record(&self, op: Op, bytes: u64, elapsed: Duration, ok: bool) {
        let i = op as usize;
        self.requests[i].inc();
        if !ok {
            self.errors[i].inc();
        } else if let Some(b) = &self.bytes[i] {
            b.inc_by(bytes);
        }
        if let Some(h) = &self.latency[i] {
            h.observe(elapsed);
        }
    }
}

/// What the daemon counts while it serves (the part that is not read from the
/// pool at scrape time). Shared by the export backends, the NBD event hook and
/// the exposition.
#[derive(Debug, Default)]
pub struct Metrics {
    requests: Family<VolumeOp, Counter>,
    errors: Family<VolumeOp, Counter>,
    bytes: Family<VolumeOp, Counter>,
    latency: Family<VolumeOp, Latency>,
    /// Handles by export name, so that each open after the first finds them.
    volumes: Mutex<HashMap<String, Arc<VolumeStats>>>,
    attached: Family<ExportLabel, Gauge>,
    attaches: Family<ExportLabel, Counter>,
    detaches: Family<ExportLabel, Counter>,
    refused_opens: Counter,
    handshake_failures: Counter,
}

impl Metrics {
    /// The handles of export `name` (a volume or `VOL@SNAP`), made on first use.
    /// Called once per NBD open, never per request.
    pub fn volume(&self, name: &str) -> Arc<VolumeStats> {
        let mut volumes = self.volumes.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(stats) = volumes.get(name) {
            return stats.clone();
        }
        let labels = |op: Op| VolumeOp {
            volume: name.to_owned(),
            op: op.as_str(),
        };
        let stats = Arc::new(VolumeStats {
            requests: Op::ALL.map(|op| self.requests.get_or_create_owned(&labels(op))),
            errors: Op::ALL.map(|op| self.errors.get_or_create_owned(&labels(op))),
            bytes: Op::ALL.map(|op| {
                op.has_bytes()
                    .then(|| self.bytes.get_or_create_owned(&labels(op)))
            }),
            latency: Op::ALL.map(|op| {
                op.timed()
                    .then(|| self.latency.get_or_create_owned(&labels(op)))
            }),
        });
        volumes.insert(name.to_owned(), stats.clone());
        stats
    }

    /// A client entered the transmission phase on `export`.
    pub fn attached(&self, export: &str) {
        let label = ExportLabel {
            export: export.to_owned(),
        };
        self.attaches.get_or_create(&label).inc();
        self.attached.get_or_create(&label).inc();
    }

    /// A client left it.
    pub fn detached(&self, export: &str) {
        let label = ExportLabel {
            export: export.to_owned(),
        };
        self.detaches.get_or_create(&label).inc();
        self.attached.get_or_create(&label).dec();
    }

    /// An open the exports refused (unknown, locked or not granted: one count,
    /// no label, since the name is the client's to choose).
    pub fn refused_open(&self) {
        self.refused_opens.inc();
    }

    /// A connection that failed before choosing an export (TLS, plaintext on a
    /// TLS listener, too slow to finish TLS).
    pub fn handshake_failed(&self) {
        self.handshake_failures.inc();
    }

    /// The registry a scrape encodes: these counters, and the pool and NBD
    /// server read at scrape time.
    fn registry(&self, pool: Option<(Arc<Pool>, Arc<Server>)>) -> Registry {
        let mut r = Registry::with_prefix(PREFIX);
        r.register(
            "volume_requests",
            "NBD requests received, by volume (export) and operation",
            self.requests.clone(),
        );
        r.register(
            "volume_request_errors",
            "NBD requests answered with an error, by volume and operation",
            self.errors.clone(),
        );
        r.register(
            "volume_bytes",
            "Bytes of NBD requests that succeeded, by volume and operation \
             (read, write, trim, write_zeroes)",
            self.bytes.clone(),
        );
        r.register(
            "volume_request_duration_seconds",
            "Time from an NBD read or write reaching the volume to its answer, in seconds",
            self.latency.clone(),
        );
        r.register(
            "nbd_attached_connections",
            "NBD connections in the transmission phase, by export",
            self.attached.clone(),
        );
        r.register(
            "nbd_attaches",
            "NBD connections that entered the transmission phase, by export",
            self.attaches.clone(),
        );
        r.register(
            "nbd_detaches",
            "NBD connections that left the transmission phase, by export",
            self.detaches.clone(),
        );
        r.register(
            "nbd_refused_opens",
            "NBD opens refused: unknown, locked or not granted export (clients see no difference)",
            self.refused_opens.clone(),
        );
        r.register(
            "nbd_handshake_failures",
            "NBD connections that failed before choosing an export (TLS failures, \
             plaintext on a TLS listener, TLS too slow)",
            self.handshake_failures.clone(),
        );
        if let Some((pool, server)) = pool {
            r.register_collector(Box::new(pool::PoolCollector::new(pool, server)));
        }
        r
    }
}

/// How a scrape wants the text (its `Accept` header decides).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// OpenMetrics 1.0 text, what Prometheus asks for first.
    OpenMetrics,
    /// Prometheus text format 0.0.4 (curl, older scrapers).
    Prometheus,
}

impl Format {
    pub fn content_type(self) -> &'static str {
        match self {
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
            Format::Prometheus => prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
        }
    }
}

/// Everything a scrape shows, ready to encode.
#[derive(Debug)]
pub struct Exposition {
    registry: Registry,
}

impl Exposition {
    pub fn new(metrics: &Metrics, pool: Arc<Pool>, server: Arc<Server>) -> Exposition {
        Exposition {
            registry: metrics.registry(Some((pool, server))),
        }
    }

    /// The text of one scrape. Reads the pool's status: call it off the async
    /// threads.
    pub fn render(&self, format: Format) -> String {
        let mut out = String::new();
        let encoded = match format {
            Format::OpenMetrics => {
                prometheus_client::encoding::text::encode(&mut out, &self.registry)
            }
            Format::Prometheus => {
                prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry)
            }
        };
        if let Err(e) = encoded {
            // Writing to a String cannot fail; a collector's error ends the text early.
            let _ = writeln!(out, "# bulwark: encoding stopped early: {e}");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(m: &Metrics, format: Format) -> String {
        let mut out = String::new();
        let registry = m.registry(None);
        match format {
            Format::OpenMetrics => {
                prometheus_client::encoding::text::encode(&mut out, &registry).unwrap()
            }
            Format::Prometheus => {
                prometheus_client::encoding::prometheus_text::encode(&mut out, &registry).unwrap()
            }
        }
        out
    }

    fn has_line(text: &str, line: &str) {
        assert!(
            text.lines().any(|l| l == line),
            "no line {line:?} in:\n{text}"
        );
    }

    #[test]
    fn requests_bytes_and_errors_are_counted_per_volume_and_op() {
        let m = Metrics::default();
        let a = m.volume("a");
        for _ in 0..3 {
            a.record(Op::Write, 4096, Duration::from_micros(10), true);
        }
        a.record(Op::Write, 4096, Duration::from_micros(10), false);
        a.record(Op::Read, 65536, Duration::from_micros(10), true);
        a.record(Op::Flush, 0, Duration::from_millis(3), true);
        // A second open of the same export shares the counters.
        m.volume("a")
            .record(Op::Trim, 1 << 20, Duration::ZERO, true);
        m.volume("b@snap")
            .record(Op::Read, 512, Duration::ZERO, true);

        let text = render(&m, Format::Prometheus);
        has_line(
            &text,
            r#"bulwark_volume_requests_total{volume="a",op="write"} 4"#,
        );
        has_line(
            &text,
            r#"bulwark_volume_request_errors_total{volume="a",op="write"} 1"#,
        );
        // Bytes of the requests that succeeded only.
        has_line(
            &text,
            r#"bulwark_volume_bytes_total{volume="a",op="write"} 12288"#,
        );
        has_line(
            &text,
            r#"bulwark_volume_bytes_total{volume="a",op="read"} 65536"#,
        );
        has_line(
            &text,
            r#"bulwark_volume_bytes_total{volume="a",op="trim"} 1048576"#,
        );
        has_line(
            &text,
            r#"bulwark_volume_requests_total{volume="a",op="flush"} 1"#,
        );
        has_line(
            &text,
            r#"bulwark_volume_bytes_total{volume="b@snap",op="read"} 512"#,
        );
        // Flush and block status have no bytes series.
        assert!(!text.contains(r#"bulwark_volume_bytes_total{volume="a",op="flush"}"#));
        has_line(&text, "# TYPE bulwark_volume_requests_total counter");
    }

    #[test]
    fn latency_histogram_buckets_are_cumulative_with_inf() {
        let m = Metrics::default();
        let v = m.volume("v");
        v.record(Op::Read, 1, Duration::from_micros(20), true); // le 50 µs
        v.record(Op::Read, 1, Duration::from_micros(50), true); // le 50 µs (inclusive)
        v.record(Op::Read, 1, Duration::from_micros(700), true); // le 1 ms
        v.record(Op::Read, 1, Duration::from_secs(3), true); // +Inf only
        let text = render(&m, Format::OpenMetrics);
        let bucket = |le: &str, n: u64| {
            format!(
                r#"bulwark_volume_request_duration_seconds_bucket{{le="{le}",volume="v",op="read"}} {n}"#
            )
        };
        has_line(&text, &bucket("0.00005", 2));
        has_line(&text, &bucket("0.0005", 2));
        has_line(&text, &bucket("0.001", 3));
        has_line(&text, &bucket("1.0", 3));
        has_line(&text, &bucket("+Inf", 4));
        has_line(
            &text,
            r#"bulwark_volume_request_duration_seconds_count{volume="v",op="read"} 4"#,
        );
        has_line(
            &text,
            r#"bulwark_volume_request_duration_seconds_sum{volume="v",op="read"} 3.00077"#,
        );
        has_line(
            &text,
            "# TYPE bulwark_volume_request_duration_seconds histogram",
        );
        // Writes have a histogram too, trims none.
        assert!(text
            .contains(r#"bulwark_volume_request_duration_seconds_count{volume="v",op="write"} 0"#));
        assert!(!text.contains(r#"op="trim",le="#));
        assert!(
            text.ends_with("# EOF\n"),
            "OpenMetrics text ends with # EOF"
        );
    }

    #[test]
    fn nbd_events_are_counted() {
        let m = Metrics::default();
        m.attached("a");
        m.attached("a");
        m.detached("a");
        m.refused_open();
        m.refused_open();
        m.handshake_failed();
        let text = render(&m, Format::Prometheus);
        has_line(&text, r#"bulwark_nbd_attaches_total{export="a"} 2"#);
        has_line(&text, r#"bulwark_nbd_detaches_total{export="a"} 1"#);
        has_line(&text, r#"bulwark_nbd_attached_connections{export="a"} 1"#);
        has_line(&text, "bulwark_nbd_refused_opens_total 2");
        has_line(&text, "bulwark_nbd_handshake_failures_total 1");
    }
}
