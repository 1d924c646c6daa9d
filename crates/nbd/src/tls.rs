//! TLS for NBD (`NBD_OPT_STARTTLS`), with OpenSSL, in the two forms QEMU,
//! libnbd and nbdkit use (they speak GnuTLS; these interoperate):
//!
//! - X.509: a directory with `ca-cert.pem`, `server-cert.pem` and
//!   `server-key.pem` (QEMU's `tls-creds-x509` layout). Client certificates
//!   are required and must verify against `ca-cert.pem`. The client is
//!   `cn:COMMON_NAME` and `sha256:FINGERPRINT` (of the DER certificate).
//! - PSK: a file of `identity:hexkey` lines (GnuTLS `psktool`'s format,
//!   QEMU's `keys.psk`), TLS 1.3 and TLS 1.2 PSK cipher suites. The client
//!   is `psk:IDENTITY`.
//!
//! Invariants: a handshake that completes has authenticated the client
//! (certificate chain or key); no key byte is logged or kept outside
//! `Zeroizing` buffers (OpenSSL keeps its own copy of the server's private
//! key for the life of the context).

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::pin::Pin;

use openssl::ex_data::Index;
use openssl::hash::MessageDigest;
use openssl::nid::Nid;
use openssl::ssl::{
    Ssl, SslAcceptor, SslContext, SslFiletype, SslMethod, SslOptions, SslVerifyMode, SslVersion,
};
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_openssl::SslStream;
use zeroize::Zeroizing;

use crate::backend::Identity;

/// Longest PSK identity accepted (GnuTLS and RFC 4279 allow 2^16 - 1 bytes;
/// real ones are names).
const PSK_IDENTITY_BYTES_MAX: usize = 1024;
/// Longest key in a PSK file (OpenSSL's `PSK_MAX_PSK_LEN`).
const PSK_KEY_BYTES_MAX: usize = 512;

#[derive(Debug, Error)]
pub enum TlsError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
    #[error("{what}: {source}")]
    Ssl {
        what: String,
        source: openssl::error::ErrorStack,
    },
}

fn ssl_err(what: impl Into<String>) -> impl FnOnce(openssl::error::ErrorStack) -> TlsError {
    let what = what.into();
    move |source| TlsError::Ssl { what, source }
}

/// How clients authenticate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsMode {
    X509,
    Psk,
}

/// A server-side TLS configuration, shared by every connection.
pub struct TlsConfig {
    context: SslContext,
    mode: TlsMode,
    /// Where the PSK callback leaves the identity it accepted
    /// (`SSL_get_psk_identity` does not report it under TLS 1.3).
    psk_identity: Option<Index<Ssl, String>>,
}

impl fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsConfig")
            .field("mode", &self.mode)
            .finish()
    }
}

/// Names of the files in an X.509 credentials directory.
pub const CA_CERT_FILE: &str = "ca-cert.pem";
pub const SERVER_CERT_FILE: &str = "server-cert.pem";
pub const SERVER_KEY_FILE: &str = "server-key.pem";

fn existing(dir: &Path, name: &str) -> Result<PathBuf, TlsError> {
    let path = dir.join(name);
    std::fs::metadata(&path).map_err(|source| TlsError::Io {
        path: path.clone(),
        source,
    })?;
    Ok(path)
}

/// Refuses a secret file (server key, PSK file) that is not a regular
/// file, belongs to another user than this process's (or root), or that
/// other users can read or write, as bulwark does for volume keys.
fn private(path: &Path) -> Result<(), TlsError> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let meta = std::fs::metadata(path).map_err(|source| TlsError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    if !meta.is_file() {
        return Err(TlsError::File {
            path: path.to_path_buf(),
            message: "holds a secret but is not a regular file".to_owned(),
        });
    }
    // SAFETY: geteuid cannot fail and touches no memory.
    let euid = unsafe { libc::geteuid() };
    if meta.uid() != euid && meta.uid() != 0 {
        return Err(TlsError::File {
            path: path.to_path_buf(),
            message: format!(
                "holds a secret but is owned by uid {}, not by this user (uid {euid}) or root \
                 (chown {euid})",
                meta.uid()
            ),
        });
    }
    let mode = meta.permissions().mode();
    if mode & 0o077 != 0 {
        return Err(TlsError::File {
            path: path.to_path_buf(),
            message: format!(
                "holds a secret but has mode {:04o}: other users can access it (chmod 600)",
                mode & 0o7777
            ),
        });
    }
    Ok(())
}

fn acceptor_base() -> Result<openssl::ssl::SslAcceptorBuilder, TlsError> {
    let mut b = SslAcceptor::mozilla_intermediate_v5(SslMethod::tls_server())
        .map_err(ssl_err("TLS context"))?;
    b.set_min_proto_version(Some(SslVersion::TLS1_2))
        .map_err(ssl_err("TLS versions"))?;
    // No session tickets or resumption: every connection authenticates.
    b.set_options(SslOptions::NO_TICKET);
    b.set_session_cache_mode(openssl::ssl::SslSessionCacheMode::OFF);
    Ok(b)
}

impl TlsConfig {
    /// X.509 from a directory holding `ca-cert.pem`, `server-cert.pem` and
    /// `server-key.pem`. Clients must present a certificate the CA signed.
    pub fn x509(dir: &Path) -> Result<TlsConfig, TlsError> {
        let ca = existing(dir, CA_CERT_FILE)?;
        let cert = existing(dir, SERVER_CERT_FILE)?;
        let key = existing(dir, SERVER_KEY_FILE)?;
        private(&key)?;
        let mut b = acceptor_base()?;
        b.set_ca_file(&ca)
            .map_err(ssl_err(format!("CA certificate {}", ca.display())))?;
        b.set_certificate_chain_file(&cert)
            .map_err(ssl_err(format!("server certificate {}", cert.display())))?;
        b.set_private_key_file(&key, SslFiletype::PEM)
            .map_err(ssl_err(format!("server key {}", key.display())))?;
        b.check_private_key().map_err(ssl_err(format!(
            "{} does not match {}",
            key.display(),
            cert.display()
        )))?;
        // Send the CA's name in the certificate request (clients choose by it).
        if let Ok(names) = openssl::x509::X509Name::load_client_ca_file(&ca) {
            b.set_client_ca_list(names);
        }
        b.set_verify(SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT);
        Ok(TlsConfig {
            context: b.build().into_context(),
            mode: TlsMode::X509,
            psk_identity: None,
        })
    }

    /// PSK from `identity:hexkey` lines.
    pub fn psk_file(path: &Path) -> Result<TlsConfig, TlsError> {
        private(path)?;
        let text =
            Zeroizing::new(
                std::fs::read_to_string(path).map_err(|source| TlsError::Io {
                    path: path.to_path_buf(),
                    source,
                })?,
            );
        let keys = parse_psk(&text).map_err(|message| TlsError::File {
            path: path.to_path_buf(),
            message,
        })?;
        Self::psk(keys)
    }

    /// PSK from identities and keys.
    pub fn psk(keys: HashMap<String, Zeroizing<Vec<u8>>>) -> Result<TlsConfig, TlsError> {
        let mut b = acceptor_base()?;
        // TLS 1.2 PSK suites (GnuTLS offers these with PSK credentials);
        // TLS 1.3 uses its default suites with the same callback.
        b.set_cipher_list(
            "ECDHE-PSK-AES256-CBC-SHA384:ECDHE-PSK-AES128-CBC-SHA256:\
             ECDHE-PSK-CHACHA20-POLY1305:DHE-PSK-AES256-GCM-SHA384:DHE-PSK-AES128-GCM-SHA256:\
             DHE-PSK-CHACHA20-POLY1305:PSK-AES256-GCM-SHA384:PSK-AES128-GCM-SHA256",
        )
        .map_err(ssl_err("PSK cipher suites"))?;
        b.set_verify(SslVerifyMode::NONE);
        let index = Ssl::new_ex_index::<String>().map_err(ssl_err("TLS ex_data index"))?;
        b.set_psk_server_callback(move |ssl, identity, out| {
            let found = identity
                .filter(|id| id.len() <= PSK_IDENTITY_BYTES_MAX)
                .and_then(|id| std::str::from_utf8(id).ok())
                .and_then(|id| keys.get_key_value(id));
            match found {
                Some((id, k)) if k.len() <= out.len() => {
                    out[..k.len()].copy_from_slice(k);
                    ssl.set_ex_data(index, id.clone());
                    Ok(k.len())
                }
                // Zero length: unknown identity, the handshake fails.
                _ => Ok(0),
            }
        });
        Ok(TlsConfig {
            context: b.build().into_context(),
            mode: TlsMode::Psk,
            psk_identity: Some(index),
        })
    }

    pub fn mode(&self) -> TlsMode {
        self.mode
    }

    /// Runs the server side of a TLS handshake on `stream`; on success
    /// returns the encrypted stream and who the client proved to be.
    pub(crate) async fn accept<S>(&self, stream: S) -> Result<(SslStream<S>, Identity), String>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let ssl = Ssl::new(&self.context).map_err(|e| e.to_string())?;
        let mut tls = SslStream::new(ssl, stream).map_err(|e| e.to_string())?;
        Pin::new(&mut tls).accept().await.map_err(|e| {
            // The library's reason (e.g. "certificate verify failed").
            match e.ssl_error() {
                Some(stack) => stack.to_string(),
                None => e.to_string(),
            }
        })?;
        let identity = identify(tls.ssl(), self.mode, self.psk_identity)?;
        Ok((tls, identity))
    }
}

fn identify(
    ssl: &openssl::ssl::SslRef,
    mode: TlsMode,
    psk_identity: Option<Index<Ssl, String>>,
) -> Result<Identity, String> {
    match mode {
        TlsMode::Psk => {
            let id = psk_identity
                .and_then(|index| ssl.ex_data(index))
                .ok_or("no PSK identity was accepted")?;
            Ok(Identity::Psk(id.clone()))
        }
        TlsMode::X509 => {
            let cert = ssl
                .peer_certificate()
                .ok_or("the client sent no certificate")?;
            let digest = cert
                .digest(MessageDigest::sha256())
                .map_err(|e| e.to_string())?;
            let sha256 = digest.iter().map(|b| format!("{b:02x}")).collect();
            let cn = cert
                .subject_name()
                .entries_by_nid(Nid::COMMONNAME)
                .next()
                .and_then(|e| e.data().to_string().ok())
                // A name with control characters (NUL included) could pass
                // for another in logs: such a client is known by fingerprint.
                .filter(|s| !s.is_empty() && !s.chars().any(char::is_control));
            Ok(Identity::Certificate { cn, sha256 })
        }
    }
}

/// Parses `identity:hexkey` lines (blank lines ignored). The key is
/// whatever follows the last colon, so identities may contain colons.
pub fn parse_psk(text: &str) -> Result<HashMap<String, Zeroizing<Vec<u8>>>, String> {
    let mut keys = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim_end_matches('\r');
        if line.trim().is_empty() {
            continue;
        }
        let n = i + 1;
        let (id, hex) = line
            .rsplit_once(':')
            .ok_or_else(|| format!("line {n}: expected identity:hexkey"))?;
        if id.is_empty() || id.len() > PSK_IDENTITY_BYTES_MAX {
            return Err(format!("line {n}: empty or overlong identity"));
        }
        let key = decode_hex(hex.trim()).ok_or_else(|| format!("line {n}: key is not hex"))?;
        if key.is_empty() || key.len() > PSK_KEY_BYTES_MAX {
            return Err(format!(
                "line {n}: key must be 1 to {PSK_KEY_BYTES_MAX} bytes"
            ));
        }
        if keys.insert(id.to_owned(), key).is_some() {
            return Err(format!("line {n}: identity {id:?} appears twice"));
        }
    }
    if keys.is_empty() {
        return Err("no identity:hexkey line".into());
    }
    Ok(keys)
}

fn decode_hex(hex: &str) -> Option<Zeroizing<Vec<u8>>> {
    if hex.len() & 1 == 1 {
        return None;
    }
    let mut out = Zeroizing::new(Vec::with_capacity(hex.len() / 2));
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    for pair in hex.as_bytes().chunks(2) {
        out.push(digit(pair[0])? << 4 | digit(pair[1])?);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psk_lines() {
        let keys = parse_psk("alice:00ff\n\nbob:with:colon:0A0b\r\n").unwrap();
        assert_eq!(&keys["alice"][..], &[0, 255]);
        assert_eq!(&keys["bob:with:colon"][..], &[10, 11]);
        for bad in ["", "nocolon", ":00", "a:0", "a:zz", "a:00\na:01", "a:"] {
            assert!(parse_psk(bad).is_err(), "{bad:?}");
        }
    }
}
