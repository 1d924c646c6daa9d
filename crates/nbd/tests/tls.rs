//! TLS on the handshake: before STARTTLS a TLS listener answers nothing
//! but STARTTLS and ABORT; after it (PSK here: no certificates to make)
//! the client is known by its PSK identity and options work again.

mod common;

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;

use bulwark_nbd::proto::*;
use bulwark_nbd::TlsConfig;
use common::*;
use openssl::ssl::{SslConnector, SslMethod, SslVerifyMode};
use zeroize::Zeroizing;

const KEY: [u8; 32] = [7; 32];

fn psk_config() -> Arc<TlsConfig> {
    let mut keys = HashMap::new();
    keys.insert("alice".to_owned(), Zeroizing::new(KEY.to_vec()));
    Arc::new(TlsConfig::psk(keys).unwrap())
}

fn connector(identity: &'static str, key: [u8; 32]) -> openssl::ssl::Ssl {
    let mut b = SslConnector::builder(SslMethod::tls_client()).unwrap();
    b.set_verify(SslVerifyMode::NONE);
    b.set_psk_client_callback(move |_, _hint, id_out, key_out| {
        id_out[..identity.len()].copy_from_slice(identity.as_bytes());
        id_out[identity.len()] = 0;
        key_out[..key.len()].copy_from_slice(&key);
        Ok(key.len())
    });
    b.build()
        .configure()
        .unwrap()
        .into_ssl("localhost")
        .unwrap()
}

#[tokio::test]
async fn nothing_before_starttls_then_options_over_tls() {
    let (server, _, _) = server();
    let (client, server_end) = tokio::io::duplex(256 << 10);
    let task = tokio::spawn(
        server
            .clone()
            .serve_stream_tls(server_end, psk_config(), None),
    );
    let mut c = Client::connect(client).await;
    // Nothing about exports before TLS.
    assert_eq!(
        c.option(OPT_LIST, &[]).await,
        vec![(
            REP_ERR_TLS_REQD,
            b"TLS is required: use NBD_OPT_STARTTLS".to_vec()
        )]
    );
    let info = InfoRequest {
        name: "disk".into(),
        requests: vec![],
    };
    assert_eq!(
        c.option(OPT_GO, &info.encode()).await[0].0,
        REP_ERR_TLS_REQD
    );
    assert_eq!(
        c.option(OPT_INFO, &info.encode()).await[0].0,
        REP_ERR_TLS_REQD
    );
    assert_eq!(
        c.option(OPT_STRUCTURED_REPLY, &[]).await[0].0,
        REP_ERR_TLS_REQD
    );
    assert_eq!(c.option(OPT_STARTTLS, b"x").await[0].0, REP_ERR_INVALID);
    assert_eq!(c.option(OPT_STARTTLS, &[]).await, vec![(REP_ACK, vec![])]);
    let mut tls = tokio_openssl::SslStream::new(connector("alice", KEY), c.s).unwrap();
    Pin::new(&mut tls).connect().await.unwrap();
    let mut c = Client::over(tls);
    assert_eq!(c.option(OPT_STARTTLS, &[]).await[0].0, REP_ERR_INVALID);
    let names: Vec<String> = c
        .option(OPT_LIST, &[])
        .await
        .iter()
        .filter(|(r, _)| *r == REP_SERVER)
        .map(|(_, p)| parse_rep_server(p).unwrap().0)
        .collect();
    assert_eq!(names, ["disk", "ro"]);
    c.structured().await;
    let (size, _) = c.go("disk").await.unwrap();
    assert_eq!(size, 1 << 20);
    c.send(CMD_DISC, 0, 0, 0, &[]).await;
    within(task).await.unwrap();
}

#[tokio::test]
async fn wrong_psk_gets_nothing() {
    let (server, _, _) = server();
    let (client, server_end) = tokio::io::duplex(256 << 10);
    let task = tokio::spawn(
        server
            .clone()
            .serve_stream_tls(server_end, psk_config(), None),
    );
    let mut c = Client::connect(client).await;
    assert_eq!(c.option(OPT_STARTTLS, &[]).await, vec![(REP_ACK, vec![])]);
    let mut tls = tokio_openssl::SslStream::new(connector("alice", [8; 32]), c.s).unwrap();
    assert!(Pin::new(&mut tls).connect().await.is_err());
    within(task).await.unwrap();
}

#[tokio::test]
async fn export_name_before_tls_hangs_up() {
    let (server, _, _) = server();
    let (client, server_end) = tokio::io::duplex(256 << 10);
    let task = tokio::spawn(
        server
            .clone()
            .serve_stream_tls(server_end, psk_config(), None),
    );
    let mut c = Client::connect(client).await;
    c.send_option(OPT_EXPORT_NAME, b"disk").await.unwrap();
    c.expect_closed().await;
    within(task).await.unwrap();
}
