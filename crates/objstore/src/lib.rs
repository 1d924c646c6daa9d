//! bulwark's object-store client (issue 22): the engine's `tier::ObjectStore` on S3 and
//! the stores that speak its dialect (MinIO, Ceph RGW, Garage, versitygw, R2, B2), through
//! Apache Arrow's `object_store` crate (ARCHITECTURE.md says why).
//!
//! The engine is synchronous; this crate runs its own small tokio runtime and answers each
//! call from any thread (a daemon's runtime thread included) by running the request there
//! and waiting for it on a channel. Every request has a deadline (`Deadlines`): a store
//! that does not answer gives an error, never a hang.
//!
//! Where the pool's root is: `s3://BUCKET[/PREFIX][?endpoint=URL&region=R]`. Credentials
//! never come from the command line: from a file (`AWS_ACCESS_KEY_ID=...` lines, mode 0600,
//! as every secret file) or the usual `AWS_*` environment variables; the secret key and
//! session token never show in `Debug`.
//!
//! Every failed request becomes one line naming the server's cause ([`Cause`]: the S3 code
//! and message, the HTTP status, a timeout, a refused connection; never the raw XML),
//! counted by kind for `status` and the metrics.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bulwark_engine::tier::{Cond, Listed, ObjectStore as Tier, PutIf, Version};
use bulwark_engine::{Error, Result};
use object_store::aws::{AmazonS3, AmazonS3Builder, S3ConditionalPut};
use object_store::path::Path as ObjPath;
use object_store::{ClientOptions, ObjectStore as _, PutMode, PutOptions, PutPayload, RetryConfig};
use zeroize::Zeroizing;

/// Where a pool's objects live, as the user gave it (kept in `pool.json`; no secret in it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    pub bucket: String,
    /// The pool's root inside the bucket ("" for the bucket's root).
    pub prefix: String,
    /// An S3-compatible server's address (`http://127.0.0.1:7070`); AWS when absent (or
    /// `AWS_ENDPOINT_URL`).
    pub endpoint: Option<String>,
    pub region: Option<String>,
}

impl Location {
    /// Parse `s3://BUCKET[/PREFIX][?endpoint=URL&region=R]`.
    pub fn parse(url: &str) -> Result<Location> {
        let bad = |why: &str| {
            Error::Invalid(format!(
                "object store URL '{url}': {why}; expected s3://BUCKET[/PREFIX][?endpoint=URL&region=REGION]"
            ))
        };
        let rest = url
            .strip_prefix("s3://")
            .ok_or_else(|| bad("only s3:// URLs are supported"))?;
        let (path, query) = match rest.split_once('?') {
            Some((p, q)) => (p, Some(q)),
            None => (rest, None),
        };
        let (bucket, prefix) = match path.split_once('/') {
            Some((b, p)) => (b, p.trim_matches('/')),
            None => (path, ""),
        };
        if bucket.contains('@') || bucket.contains(':') {
            return Err(bad("credentials do not go in the URL (use --object-store-credentials FILE or AWS_* variables)"));
        }
        let valid_bucket = (3..=63).contains(&bucket.len())
            && bucket
                .bytes()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-' || c == b'.');
        if !valid_bucket {
            return Err(bad(
                "the bucket name must be 3 to 63 lowercase letters, digits, '-' or '.'",
            ));
        }
        if prefix.split('/').any(|p| p == "." || p == "..") || prefix.contains("//") {
            return Err(bad("the prefix may not hold '.', '..' or empty parts"));
        }
        let mut loc = Location {
            bucket: bucket.to_string(),
            prefix: prefix.to_string(),
            endpoint: None,
            region: None,
        };
        for kv in query.unwrap_or("").split('&').filter(|s| !s.is_empty()) {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| bad("a query part is not KEY=VALUE"))?;
            match k {
                "endpoint" => {
                    if !(v.starts_with("http://") || v.starts_with("https://")) {
                        return Err(bad("endpoint must be an http:// or https:// URL"));
                    }
                    if v.contains('@') {
                        return Err(bad("credentials do not go in the endpoint URL"));
                    }
                    loc.endpoint = Some(v.trim_end_matches('/').to_string());
                }
                "region" => loc.region = Some(v.to_string()),
                other => return Err(bad(&format!("unknown option '{other}'"))),
            }
        }
        Ok(loc)
    }
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "s3://{}", self.bucket)?;
        if !self.prefix.is_empty() {
            write!(f, "/{}", self.prefix)?;
        }
        let mut sep = '?';
        if let Some(e) = &self.endpoint {
            write!(f, "{sep}endpoint={e}")?;
            sep = '&';
        }
        if let Some(r) = &self.region {
            write!(f, "{sep}region={r}")?;
        }
        Ok(())
    }
}

/// Access keys read from a credentials file: `KEY=VALUE` lines (`AWS_ACCESS_KEY_ID`,
/// `AWS_SECRET_ACCESS_KEY`, optionally `AWS_SESSION_TOKEN` and `AWS_REGION`); `#` starts a
/// comment. The file is checked as every secret file is (regular, ours, mode 0600).
#[derive(Default)]
pub struct Credentials {
    access_key_id: Option<String>,
    secret_access_key: Option<Zeroizing<String>>,
    session_token: Option<Zeroizing<String>>,
    region: Option<String>,
}

/// Shows which keys are set, never their values.
impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("access_key_id", &self.access_key_id)
            .field(
                "secret_access_key",
                &self.secret_access_key.as_ref().map(|_| "<redacted>"),
            )
            .field(
                "session_token",
                &self.session_token.as_ref().map(|_| "<redacted>"),
            )
            .field("region", &self.region)
            .finish()
    }
}

impl Credentials {
    pub fn from_file(path: &Path) -> Result<Credentials> {
        let bytes = bulwark_engine::keys::read_secret_file(path)?;
        let text = std::str::from_utf8(&bytes).map_err(|_| {
            Error::Invalid(format!(
                "{}: credentials file is not UTF-8 text",
                path.display()
            ))
        })?;
        let mut c = Credentials::default();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let line = line.strip_prefix("export ").unwrap_or(line);
            let Some((k, v)) = line.split_once('=') else {
                return Err(Error::Invalid(format!(
                    "{} line {}: expected KEY=VALUE (AWS_ACCESS_KEY_ID=..., AWS_SECRET_ACCESS_KEY=...)",
                    path.display(),
                    n + 1
                )));
            };
            let v = v.trim().trim_matches('"').to_string();
            match k.trim() {
                "AWS_ACCESS_KEY_ID" => c.access_key_id = Some(v),
                "AWS_SECRET_ACCESS_KEY" => c.secret_access_key = Some(Zeroizing::new(v)),
                "AWS_SESSION_TOKEN" => c.session_token = Some(Zeroizing::new(v)),
                "AWS_REGION" | "AWS_DEFAULT_REGION" => c.region = Some(v),
                other => {
                    return Err(Error::Invalid(format!(
                        "{} line {}: unknown key '{other}'",
                        path.display(),
                        n + 1
                    )))
                }
            }
        }
        if c.access_key_id.is_none() != c.secret_access_key.is_none() {
            return Err(Error::Invalid(format!(
                "{}: give both AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
                path.display()
            )));
        }
        Ok(c)
    }
}

/// The most objects one listing returns (garbage collection lists the pool's objects).
const LIST_MAX: usize = 4 << 20;

/// How long the client waits: for one request, and for all the tries of one call. A call
/// that runs out gives an error (a FLUSH then fails by its deadline instead of hanging).
/// The request's bound is below the call's, so one call ends within about the two.
#[derive(Debug, Clone, Copy)]
pub struct Deadlines {
    pub request: Duration,
    pub call: Duration,
}

impl Default for Deadlines {
    fn default() -> Self {
        Deadlines {
            request: Duration::from_secs(10),
            call: Duration::from_secs(15),
        }
    }
}

/// The S3 client of one pool root.
pub struct S3 {
    loc: Location,
    store: Arc<AmazonS3>,
    rt: tokio::runtime::Runtime,
    /// Failed requests in this run, by `Cause::kind`.
    errors: std::sync::Mutex<std::collections::BTreeMap<&'static str, u64>>,
}

impl S3 {
    /// A client for `loc`, with credentials from `credentials` if given, else from the
    /// environment (`AWS_ACCESS_KEY_ID`, ...). Makes no request.
    pub fn open(loc: &Location, credentials: Option<&Path>, deadlines: Deadlines) -> Result<S3> {
        let mut b = AmazonS3Builder::from_env()
            .with_bucket_name(&loc.bucket)
            .with_conditional_put(S3ConditionalPut::ETagMatch)
            .with_retry(RetryConfig {
                max_retries: 4,
                retry_timeout: deadlines.call,
                ..Default::default()
            })
            .with_client_options(
                ClientOptions::new()
                    .with_timeout(deadlines.request)
                    .with_connect_timeout(Duration::from_secs(5))
                    .with_allow_http(true),
            );
        if let Some(e) = &loc.endpoint {
            b = b.with_endpoint(e).with_virtual_hosted_style_request(false);
        }
        if let Some(path) = credentials {
            let c = Credentials::from_file(path)?;
            if let (Some(id), Some(secret)) = (&c.access_key_id, &c.secret_access_key) {
                b = b
                    .with_access_key_id(id)
                    .with_secret_access_key(secret.as_str());
            }
            if let Some(t) = &c.session_token {
                b = b.with_token(t.as_str());
            }
            if let Some(r) = &c.region {
                b = b.with_region(r);
            }
        }
        if let Some(r) = &loc.region {
            b = b.with_region(r);
        }
        let store = b
            .build()
            .map_err(|e| Error::Invalid(format!("object store {loc}: {e}")))?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("bulwark-objstore")
            .enable_all()
            .build()
            .map_err(Error::Io)?;
        Ok(S3 {
            loc: loc.clone(),
            store: Arc::new(store),
            rt,
            errors: Default::default(),
        })
    }

    fn path(&self, name: &str) -> ObjPath {
        if self.loc.prefix.is_empty() {
            ObjPath::from(name)
        } else {
            ObjPath::from(format!("{}/{name}", self.loc.prefix))
        }
    }

    /// Run `f` on this client's runtime and wait for it, from any thread.
    fn run<T: Send + 'static>(
        &self,
        f: impl std::future::Future<Output = std::result::Result<T, object_store::Error>>
            + Send
            + 'static,
    ) -> std::result::Result<T, object_store::Error> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.rt.spawn(async move {
            let _ = tx.send(f.await);
        });
        // A request task that panicked dropped its sender: an error, never a panic here.
        rx.recv().unwrap_or_else(|_| {
            Err(object_store::Error::Generic {
                store: "bulwark",
                source: "the request's task ended without an answer".into(),
            })
        })
    }

    /// A failed request as one line: what was asked and the cause the server gave (its S3
    /// error code and message, an HTTP status, a timeout, a refused connection), never
    /// the raw reply. Counted by kind for `status` and the metrics.
    fn error(&self, what: &str, name: &str, e: object_store::Error) -> Error {
        let c = Cause::of(&e);
        self.count(c.kind);
        let msg = format!("object store {}: {what} {name}: {}", self.loc, c.text);
        match c.kind {
            "timeout" => Error::Io(std::io::Error::new(std::io::ErrorKind::TimedOut, msg)),
            _ => Error::Io(std::io::Error::other(msg)),
        }
    }

    fn count(&self, kind: &'static str) {
        let mut m = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        *m.entry(kind).or_default() += 1;
    }

    /// A 404 that says the object is missing, not the bucket (`NoSuchBucket` is an error:
    /// a missing bucket must not read as an empty pool, nor as a refused condition).
    fn is_missing_object(e: &object_store::Error) -> bool {
        matches!(e, object_store::Error::NotFound { .. }) && Cause::of(e).kind != "no_such_bucket"
    }
}

/// Why a request failed: `kind` (a bounded set, a metric label) and a one-line `text`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cause {
    pub kind: &'static str,
    pub text: String,
}

/// The longest cause text kept (a server's message is input).
const CAUSE_TEXT_MAX: usize = 240;

/// S3 error codes counted by name; any other is counted by its HTTP status class.
const KNOWN_CODES: [(&str, &str); 9] = [
    ("NoSuchBucket", "no_such_bucket"),
    ("AccessDenied", "access_denied"),
    ("SignatureDoesNotMatch", "signature_does_not_match"),
    ("InvalidAccessKeyId", "invalid_access_key_id"),
    ("ExpiredToken", "expired_token"),
    ("SlowDown", "slow_down"),
    ("RequestTimeTooSkewed", "clock_skew"),
    ("InternalError", "server_error"),
    ("ServiceUnavailable", "server_error"),
];

/// Every error kind `Cause::of` gives, for the metrics' series.
pub const CAUSE_KINDS: [&str; 12] = [
    "no_such_bucket",
    "access_denied",
    "signature_does_not_match",
    "invalid_access_key_id",
    "expired_token",
    "slow_down",
    "clock_skew",
    "server_error",
    "client_error",
    "timeout",
    "connect",
    "other",
];

fn between<'a>(s: &'a str, open: &str, close: &str) -> Option<&'a str> {
    let start = s.find(open)? + open.len();
    let len = s[start..].find(close)?;
    Some(&s[start..start + len])
}

fn one_line(s: &str) -> String {
    let mut t: String = s.split_whitespace().collect::<Vec<_>>().join(" ");
    if t.len() > CAUSE_TEXT_MAX {
        let mut cut = CAUSE_TEXT_MAX;
        while !t.is_char_boundary(cut) {
            cut -= 1;
        }
        t.truncate(cut);
        t.push_str("...");
    }
    t
}

impl Cause {
    pub fn of(e: &object_store::Error) -> Cause {
        let full = e.to_string();
        let status = between(&full, "status code: ", ":")
            .or_else(|| between(&full, "status code: ", " "))
            .and_then(|s| s.split_whitespace().next())
            .and_then(|s| s.parse::<u16>().ok());
        if let Some(code) = between(&full, "<Code>", "</Code>") {
            let kind = KNOWN_CODES
                .iter()
                .find(|(c, _)| *c == code)
                .map(|(_, k)| *k)
                .unwrap_or(match status {
                    Some(s) if s >= 500 => "server_error",
                    _ => "client_error",
                });
            let message = between(&full, "<Message>", "</Message>").unwrap_or("");
            let status = status.map(|s| format!(" (HTTP {s})")).unwrap_or_default();
            let text = if message.is_empty() {
                format!("{code}{status}")
            } else {
                format!("{code}{status}: {message}")
            };
            return Cause {
                kind,
                text: one_line(&text),
            };
        }
        if let Some(s) = status {
            let kind = if s >= 500 {
                "server_error"
            } else {
                "client_error"
            };
            // Retried answers (5xx, 429) reach us without their body: the status says it.
            let what = match s {
                503 => " Service Unavailable (the server is overloaded or down: SlowDown)",
                500 => " Internal Server Error",
                429 => " Too Many Requests",
                403 => " Forbidden",
                404 => " Not Found",
                _ => "",
            };
            return Cause {
                kind,
                text: format!("HTTP {s}{what}"),
            };
        }
        // No answer from the server: the innermost cause (a refused connection, a timeout).
        let mut inner: &dyn std::error::Error = e;
        let mut io_kind = None;
        while let Some(s) = inner.source() {
            if let Some(io) = s.downcast_ref::<std::io::Error>() {
                io_kind = Some(io.kind());
            }
            inner = s;
        }
        let root = one_line(&inner.to_string());
        let lower = full.to_ascii_lowercase();
        let connect = matches!(
            io_kind,
            Some(
                std::io::ErrorKind::ConnectionRefused
                    | std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::NotConnected
                    | std::io::ErrorKind::ConnectionAborted
            )
        ) || (lower.contains("error sending request")
            && !lower.contains("timed out"))
            || lower.contains("dns error");
        if connect {
            return Cause {
                kind: "connect",
                text: format!("cannot reach the server ({root})"),
            };
        }
        // ("retry_timeout" in the retry summary is not a timeout: only the causes count.)
        let timed_out = io_kind == Some(std::io::ErrorKind::TimedOut)
            || lower.contains("timed out")
            || lower.contains("deadline has elapsed");
        if timed_out {
            return Cause {
                kind: "timeout",
                text: "timeout: the server did not answer in time".into(),
            };
        }
        Cause {
            kind: "other",
            text: one_line(&full),
        }
    }
}

fn version_of(e_tag: Option<String>, version: Option<String>) -> Version {
    Version {
        etag: e_tag,
        version,
    }
}

impl Tier for S3 {
    fn put(&self, name: &str, body: Vec<u8>) -> Result<()> {
        let (store, path) = (self.store.clone(), self.path(name));
        self.run(async move { store.put(&path, PutPayload::from(body)).await })
            .map(|_| ())
            .map_err(|e| self.error("PUT", name, e))
    }

    fn put_if(&self, name: &str, body: Vec<u8>, cond: &Cond) -> Result<PutIf> {
        let mode = match cond {
            Cond::Absent => PutMode::Create,
            Cond::Matches(v) => PutMode::Update(object_store::UpdateVersion {
                e_tag: v.etag.clone(),
                version: v.version.clone(),
            }),
        };
        let (store, path) = (self.store.clone(), self.path(name));
        let r = self.run(async move {
            store
                .put_opts(&path, PutPayload::from(body), PutOptions::from(mode))
                .await
        });
        match r {
            Ok(r) => Ok(PutIf::Done(version_of(r.e_tag, r.version))),
            // 404: If-Match on an object that does not exist (any more).
            Err(object_store::Error::Precondition { .. })
            | Err(object_store::Error::AlreadyExists { .. }) => Ok(PutIf::Refused),
            Err(e) if Self::is_missing_object(&e) => Ok(PutIf::Refused),
            Err(e) => Err(self.error("conditional PUT", name, e)),
        }
    }

    fn get(&self, name: &str, max_bytes: u64) -> Result<Option<(Vec<u8>, Version)>> {
        let (store, path) = (self.store.clone(), self.path(name));
        // The size first, then at most that many bytes (an object replaced meanwhile by a
        // larger one is cut short, and fails its checks): never more than `max_bytes`.
        let r = self.run(async move {
            let meta = store.head(&path).await?;
            if meta.size > max_bytes {
                return Ok(Err(meta.size));
            }
            let got = store
                .get_opts(
                    &path,
                    object_store::GetOptions {
                        range: (meta.size > 0).then_some((0..meta.size).into()),
                        ..Default::default()
                    },
                )
                .await?;
            let v = version_of(got.meta.e_tag.clone(), got.meta.version.clone());
            Ok::<_, object_store::Error>(Ok((got.bytes().await?.to_vec(), v)))
        });
        match r {
            Ok(Ok(x)) => Ok(Some(x)),
            Ok(Err(size)) => Err(Error::Corrupt(format!(
                "object store {}: {name} holds {size} bytes, more than the {max_bytes} it may",
                self.loc
            ))),
            Err(e) if Self::is_missing_object(&e) => Ok(None),
            Err(e) => Err(self.error("GET", name, e)),
        }
    }

    fn get_range(&self, name: &str, start: u64, len: u64) -> Result<Vec<u8>> {
        let (store, path) = (self.store.clone(), self.path(name));
        let r = self.run(async move { store.get_range(&path, start..start + len).await });
        match r {
            Ok(b) if b.len() as u64 == len => Ok(b.to_vec()),
            Ok(b) => Err(Error::Corrupt(format!(
                "object store {}: {name} gave {} bytes for a range of {len} at {start}",
                self.loc,
                b.len()
            ))),
            Err(e) if Self::is_missing_object(&e) => Err(Error::NotFound(format!(
                "object store {}: {name} is missing",
                self.loc
            ))),
            Err(e) => Err(self.error("GET", name, e)),
        }
    }

    fn delete(&self, name: &str) -> Result<()> {
        let (store, path) = (self.store.clone(), self.path(name));
        match self.run(async move { store.delete(&path).await }) {
            Ok(()) => Ok(()),
            Err(e) if Self::is_missing_object(&e) => Ok(()),
            Err(e) => Err(self.error("DELETE", name, e)),
        }
    }

    fn list(&self, prefix: &str) -> Result<Vec<Listed>> {
        use futures::{StreamExt, TryStreamExt};
        let (store, path) = (self.store.clone(), self.path(prefix));
        let root = if self.loc.prefix.is_empty() {
            String::new()
        } else {
            format!("{}/", self.loc.prefix)
        };
        let r = self.run(async move {
            store
                .list(Some(&path))
                .take(LIST_MAX + 1)
                .map_ok(|m| {
                    (
                        m.location.to_string(),
                        m.size,
                        m.last_modified.timestamp().max(0) as u64,
                    )
                })
                .try_collect::<Vec<_>>()
                .await
        });
        let found = r.map_err(|e| self.error("LIST", prefix, e))?;
        if found.len() > LIST_MAX {
            return Err(Error::Corrupt(format!(
                "object store {}: more than {LIST_MAX} objects under {prefix}",
                self.loc
            )));
        }
        Ok(found
            .into_iter()
            .filter_map(|(n, size, modified)| {
                n.strip_prefix(&root).map(|n| Listed {
                    name: n.to_string(),
                    size,
                    modified,
                })
            })
            .collect())
    }

    fn describe(&self) -> String {
        self.loc.to_string()
    }

    fn request_errors(&self) -> Vec<(&'static str, u64)> {
        let m = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        m.iter().map(|(k, v)| (*k, *v)).collect()
    }
}

/// Open the store a pool names: `url` and its credentials file, if any.
pub fn open(url: &str, credentials: Option<&PathBuf>) -> Result<S3> {
    S3::open(
        &Location::parse(url)?,
        credentials.map(|p| p.as_path()),
        Deadlines::default(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_and_print_back() {
        let l =
            Location::parse("s3://my-bucket/pools/tank?endpoint=http://127.0.0.1:7070&region=eu-1")
                .unwrap();
        assert_eq!(l.bucket, "my-bucket");
        assert_eq!(l.prefix, "pools/tank");
        assert_eq!(l.endpoint.as_deref(), Some("http://127.0.0.1:7070"));
        assert_eq!(l.region.as_deref(), Some("eu-1"));
        assert_eq!(Location::parse(&l.to_string()).unwrap(), l);
        assert_eq!(Location::parse("s3://bkt").unwrap().prefix, "");
    }

    #[test]
    fn bad_urls_are_refused_with_the_reason() {
        for (url, why) in [
            ("http://bucket/x", "only s3://"),
            ("s3://AKIA:secret@bucket/x", "credentials"),
            ("s3://Bucket_Upper", "bucket name"),
            ("s3://bkt/a/../b", "'..'"),
            ("s3://bkt/x?endpoint=ftp://h", "http://"),
            ("s3://bkt/x?color=red", "unknown option"),
        ] {
            let e = Location::parse(url).unwrap_err().to_string();
            assert!(e.contains(why), "{url}: {e}");
        }
    }

    #[test]
    fn a_servers_error_is_one_line_naming_its_code() {
        let xml = "Server returned non-2xx status code: 403 Forbidden: <?xml version=\"1.0\" \
                   encoding=\"UTF-8\"?>\n<Error><Code>SignatureDoesNotMatch</Code><Message>The \
                   request signature we calculated does not match the signature you \
                   provided.</Message><StringToSign>AWS4-HMAC-SHA256\n20261203T000000Z\n...\
                   </StringToSign><CanonicalRequest>PUT\n/bucket/x\n...</CanonicalRequest>\
                   </Error>";
        let e = object_store::Error::Generic {
            store: "S3",
            source: xml.into(),
        };
        let c = Cause::of(&e);
        assert_eq!(c.kind, "signature_does_not_match");
        assert_eq!(
            c.text,
            "SignatureDoesNotMatch (HTTP 403): The request signature we calculated does not \
             match the signature you provided."
        );
        let e = object_store::Error::NotFound {
            path: "x".into(),
            source: "Server returned non-2xx status code: 404 Not Found: <Error><Code>\
                     NoSuchBucket</Code></Error>"
                .into(),
        };
        assert_eq!(Cause::of(&e).kind, "no_such_bucket");
        assert!(!S3::is_missing_object(&e));
        let e = object_store::Error::Generic {
            store: "S3",
            source: "Error performing PUT http://h/x in 15s, after 4 retries, max_retries: 4, \
                     retry_timeout: 15s - Server returned non-2xx status code: 503 Service \
                     Unavailable: "
                .into(),
        };
        assert_eq!(Cause::of(&e).kind, "server_error");
        assert!(Cause::of(&e).text.starts_with("HTTP 503"));
        for k in KNOWN_CODES.iter().map(|(_, k)| k) {
            assert!(CAUSE_KINDS.contains(k), "{k}");
        }
    }

    #[test]
    fn credentials_file_is_a_secret_file() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("creds");
        std::fs::write(
            &p,
            "# test\nAWS_ACCESS_KEY_ID=AK\nAWS_SECRET_ACCESS_KEY=\"SK\"\n",
        )
        .unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(Credentials::from_file(&p)
            .unwrap_err()
            .to_string()
            .contains("chmod 600"));
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        let c = Credentials::from_file(&p).unwrap();
        assert_eq!(c.access_key_id.as_deref(), Some("AK"));
        assert_eq!(
            c.secret_access_key.as_deref().map(|s| s.as_str()),
            Some("SK")
        );
        std::fs::write(&p, "AWS_ACCESS_KEY_ID=AK\n").unwrap();
        assert!(Credentials::from_file(&p)
            .unwrap_err()
            .to_string()
            .contains("both"));
        std::fs::write(&p, "PASSWORD=x\n").unwrap();
        assert!(Credentials::from_file(&p)
            .unwrap_err()
            .to_string()
            .contains("unknown key"));
    }
}
