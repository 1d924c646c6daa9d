//! The metrics endpoint: `GET /metrics` over plain HTTP/1.1, one request per
//! connection (`Connection: close`), on a tokio `TcpListener`.
//!
//! Small on purpose: a scraper needs one GET, and a web framework would be
//! most of the daemon's dependencies. What it serves is not secret but not
//! public either (volume names, device paths, I/O rates), and it has no
//! authentication or TLS: so it binds loopback addresses only unless the
//! operator passes `--metrics-allow-remote` (`bind` checks every address the
//! name resolves to before binding, and the bound one after).
//!
//! Bounds, so that the endpoint cannot be used to make the daemon hold
//! memory or threads: at most `CONNECTIONS_MAX` connections at once (more are
//! closed at once), a request head of at most `HEAD_BYTES_MAX` that must
//! arrive, and its answer be read, within `REQUEST_TIMEOUT`; at most
//! `RENDERS_MAX` scrapes render at once (each reads the pool's status on
//! the blocking pool), others get 503.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tracing::{debug, warn};

use super::{Exposition, Format};
use crate::error::{Error, Result};

/// Connections served at once; more are closed without an answer.
const CONNECTIONS_MAX: usize = 16;
/// Scrapes rendering at once; more are answered 503.
const RENDERS_MAX: usize = 2;
/// Longest request head (request line and headers) read.
const HEAD_BYTES_MAX: usize = 8 * 1024;
/// Time a connection has to send its request and read the answer.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause after a failed accept (for example EMFILE) before trying again.
const ACCEPT_RETRY_DELAY: Duration = Duration::from_millis(100);

/// Listens on `addr` (HOST:PORT) for scrapes. Without `allow_remote`, every
/// address `addr` names must be a loopback address, or nothing is bound and the
/// error says why.
pub async fn bind(addr: &str, allow_remote: bool) -> Result<(TcpListener, SocketAddr)> {
    let resolved: Vec<SocketAddr> = tokio::net::lookup_host(addr)
        .await
        .map_err(|e| Error::usage(format!("--metrics-listen {addr}: {e} (expected HOST:PORT)")))?
        .collect();
    if resolved.is_empty() {
        return Err(Error::usage(format!(
            "--metrics-listen {addr}: the name resolves to no address"
        )));
    }
    let refuse = |ip: std::net::IpAddr| {
        Error::usage(format!(
            "--metrics-listen {addr}: {ip} is not a loopback address; metrics are served \
             over plain HTTP without authentication, so only loopback is allowed \
             (add --metrics-allow-remote to serve them on other addresses)"
        ))
    };
    if !allow_remote {
        if let Some(remote) = resolved.iter().find(|a| !a.ip().is_loopback()) {
            return Err(refuse(remote.ip()));
        }
    }
    let listener = TcpListener::bind(&resolved[..])
        .await
        .map_err(|e| Error::msg(format!("cannot listen on {addr} for metrics: {e}")))?;
    let local = listener
        .local_addr()
        .map_err(|e| Error::msg(format!("cannot listen on {addr} for metrics: {e}")))?;
    if !allow_remote && !local.ip().is_loopback() {
        return Err(refuse(local.ip()));
    }
    Ok((listener, local))
}

/// Answers scrapes until the task is dropped; returns only if the listener
/// itself fails.
pub async fn serve(listener: TcpListener, exposition: Arc<Exposition>) -> io::Result<()> {
    let connections = Arc::new(Semaphore::new(CONNECTIONS_MAX));
    let renders = Arc::new(Semaphore::new(RENDERS_MAX));
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) if is_fatal(&e) => return Err(e),
            Err(e) => {
                warn!("metrics: accept failed: {e}");
                tokio::time::sleep(ACCEPT_RETRY_DELAY).await;
                continue;
            }
        };
        let Ok(permit) = connections.clone().try_acquire_owned() else {
            debug!(%peer, "metrics: {CONNECTIONS_MAX} connections open: closing a new one");
            continue;
        };
        let (exposition, renders) = (exposition.clone(), renders.clone());
        tokio::spawn(async move {
            match tokio::time::timeout(REQUEST_TIMEOUT, answer(stream, &exposition, &renders)).await
            {
                Ok(Ok(())) => {}
                Ok(Err(e)) => debug!(%peer, "metrics: {e}"),
                Err(_) => debug!(%peer, "metrics: request not done within {REQUEST_TIMEOUT:?}"),
            }
            drop(permit);
        });
    }
}

fn is_fatal(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EBADF | libc::EINVAL | libc::ENOTSOCK | libc::EFAULT)
    )
}

/// What one request asks for.
#[derive(Debug, PartialEq, Eq)]
enum Asked {
    Metrics { format: Format, head_only: bool },
    Index { head_only: bool },
    NotFound,
    MethodNotAllowed,
    Bad(&'static str),
}

/// Reads the request head and answers it.
async fn answer(
    mut stream: TcpStream,
    exposition: &Arc<Exposition>,
    renders: &Arc<Semaphore>,
) -> io::Result<()> {
    let head = match read_head(&mut stream).await? {
        Some(head) => head,
        None => return Ok(()), // closed before a whole head
    };
    let (status, content_type, body, head_only) = match parse(&head) {
        Asked::Metrics { format, head_only } => match renders.clone().try_acquire_owned() {
            Ok(permit) => {
                let exposition = exposition.clone();
                let text = tokio::task::spawn_blocking(move || {
                    let text = exposition.render(format);
                    drop(permit);
                    text
                })
                .await
                .map_err(|e| io::Error::other(format!("rendering the metrics failed: {e}")))?;
                ("200 OK", format.content_type(), text, head_only)
            }
            Err(_) => (
                "503 Service Unavailable",
                "text/plain; charset=utf-8",
                "scrapes already running; try again\n".to_owned(),
                false,
            ),
        },
        Asked::Index { head_only } => (
            "200 OK",
            "text/plain; charset=utf-8",
            "bulwark metrics: GET /metrics\n".to_owned(),
            head_only,
        ),
        Asked::NotFound => (
            "404 Not Found",
            "text/plain; charset=utf-8",
            "not found: the metrics are at /metrics\n".to_owned(),
            false,
        ),
        Asked::MethodNotAllowed => (
            "405 Method Not Allowed",
            "text/plain; charset=utf-8",
            "only GET and HEAD\n".to_owned(),
            false,
        ),
        Asked::Bad(why) => (
            "400 Bad Request",
            "text/plain; charset=utf-8",
            format!("{why}\n"),
            false,
        ),
    };
    let mut out = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
         Cache-Control: no-store\r\nConnection: close\r\n",
        body.len()
    );
    if status.starts_with("405") {
        out.push_str("Allow: GET, HEAD\r\n");
    }
    out.push_str("\r\n");
    if !head_only {
        out.push_str(&body);
    }
    stream.write_all(out.as_bytes()).await?;
    stream.shutdown().await
}

/// The request head (up to and without the blank line), or `None` if the
/// client closed first; an error if it is longer than `HEAD_BYTES_MAX`.
async fn read_head(stream: &mut TcpStream) -> io::Result<Option<String>> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        if let Some(end) = find_blank_line(&buf) {
            buf.truncate(end);
            return Ok(Some(String::from_utf8_lossy(&buf).into_owned()));
        }
        if buf.len() > HEAD_BYTES_MAX {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("request head longer than {HEAD_BYTES_MAX} bytes"),
            ));
        }
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

fn find_blank_line(buf: &[u8]) -> Option<usize> {
    if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
        return Some(i);
    }
    // Tolerate bare LF line ends (hand-typed requests).
    buf.windows(2).position(|w| w == b"\n\n")
}

fn parse(head: &str) -> Asked {
    let mut lines = head.lines();
    let request = lines.next().unwrap_or("");
    let mut parts = request.split_whitespace();
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Asked::Bad("malformed request line");
    };
    if !version.starts_with("HTTP/1.") {
        return Asked::Bad("HTTP/1.0 or HTTP/1.1 only");
    }
    let head_only = match method {
        "GET" => false,
        "HEAD" => true,
        _ => return Asked::MethodNotAllowed,
    };
    let path = target.split(['?', '#']).next().unwrap_or("");
    match path {
        "/metrics" => {
            let openmetrics = lines.any(|l| {
                l.split_once(':').is_some_and(|(name, value)| {
                    name.trim().eq_ignore_ascii_case("accept")
                        && value.contains("application/openmetrics-text")
                })
            });
            let format = if openmetrics {
                Format::OpenMetrics
            } else {
                Format::Prometheus
            };
            Asked::Metrics { format, head_only }
        }
        "/" => Asked::Index { head_only },
        _ => Asked::NotFound,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_parsed() {
        let prom = "GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5";
        assert_eq!(
            parse(prom),
            Asked::Metrics {
                format: Format::OpenMetrics,
                head_only: false
            }
        );
        assert_eq!(
            parse("GET /metrics?x=1 HTTP/1.0\r\nAccept: */*"),
            Asked::Metrics {
                format: Format::Prometheus,
                head_only: false
            }
        );
        assert_eq!(
            parse("HEAD /metrics HTTP/1.1"),
            Asked::Metrics {
                format: Format::Prometheus,
                head_only: true
            }
        );
        assert_eq!(parse("GET / HTTP/1.1"), Asked::Index { head_only: false });
        assert_eq!(parse("GET /other HTTP/1.1"), Asked::NotFound);
        assert_eq!(parse("POST /metrics HTTP/1.1"), Asked::MethodNotAllowed);
        assert!(matches!(parse("GET /metrics"), Asked::Bad(_)));
        assert!(matches!(parse("GET /metrics HTTP/2"), Asked::Bad(_)));
        assert!(matches!(parse(""), Asked::Bad(_)));
    }

    #[tokio::test]
    async fn non_loopback_needs_allow_remote() {
        let e = bind("0.0.0.0:0", false).await.unwrap_err();
        assert!(
            e.to_string().contains("--metrics-allow-remote"),
            "the refusal says how to allow it: {e}"
        );
        assert_eq!(e.exit_code(), 2);
        let (_l, local) = bind("127.0.0.1:0", false).await.unwrap();
        assert!(local.ip().is_loopback());
        let (_l, local) = bind("0.0.0.0:0", true).await.unwrap();
        assert!(local.ip().is_unspecified());
        assert!(bind("no-port", false).await.is_err());
    }
}
