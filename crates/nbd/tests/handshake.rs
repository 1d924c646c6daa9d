//! Option haggling, option by option, over an in-memory pipe: every
//! option gets the reply the spec prescribes, and the connection is closed
//! exactly where the spec says it must (or may) be.

mod common;

use bulwark_nbd::proto::*;
use common::*;
use tokio::io::AsyncWriteExt;

#[tokio::test]
async fn list_names_every_export() {
    let (server, _, _) = server();
    let (s, task) = pipe(&server);
    let mut c = Client::connect(s).await;
    let replies = c.option(OPT_LIST, &[]).await;
    let names: Vec<String> = replies
        .iter()
        .filter(|(r, _)| *r == REP_SERVER)
        .map(|(_, p)| parse_rep_server(p).unwrap().0)
        .collect();
    assert_eq!(names, vec!["disk", "ro"]);
    assert_eq!(replies.last().unwrap().0, REP_ACK);
    // LIST with data is invalid, and the session goes on.
    let r = c.option(OPT_LIST, b"x").await;
    assert_eq!(r[0].0, REP_ERR_INVALID);
    assert_eq!(c.option(OPT_ABORT, &[]).await, vec![(REP_ACK, vec![])]);
    c.expect_closed().await;
    within(task).await.unwrap();
}

#[tokio::test]
async fn info_then_go() {
    let (server, _, _) = server();
    let (s, _task) = pipe(&server);
    let mut c = Client::connect(s).await;
    let req = InfoRequest {
        name: "disk".into(),
        requests: vec![INFO_NAME, INFO_BLOCK_SIZE, INFO_DESCRIPTION, 999],
    };
    let replies = c.option(OPT_INFO, &req.encode()).await;
    let infos: Vec<Info> = replies
        .iter()
        .filter(|(r, _)| *r == REP_INFO)
        .map(|(_, p)| parse_info(p).unwrap())
        .collect();
    assert!(infos.contains(&Info::BlockSize {
        minimum: 1,
        preferred: 4096,
        maximum: 64 << 10
    }));
    assert!(infos.contains(&Info::Name("disk".into())));
    let Some(Info::Export { size, flags }) = infos.first().cloned() else {
        panic!("no export info first: {infos:?}");
    };
    assert_eq!(size, 1 << 20);
    assert_eq!(flags & FLAG_SEND_DF, 0, "DF needs structured replies");
    assert_eq!(replies.last().unwrap().0, REP_ACK);
    // INFO does not attach; GO does.
    assert_eq!(server.attached("disk"), 0);
    let (size, flags) = c.go("disk").await.unwrap();
    assert_eq!(size, 1 << 20);
    for f in [
        FLAG_HAS_FLAGS,
        FLAG_SEND_FLUSH,
        FLAG_SEND_FUA,
        FLAG_SEND_TRIM,
        FLAG_SEND_WRITE_ZEROES,
        FLAG_SEND_FAST_ZERO,
        FLAG_CAN_MULTI_CONN,
    ] {
        assert_ne!(flags & f, 0, "flag {f:#x} missing from {flags:#x}");
    }
    assert_eq!(flags & FLAG_READ_ONLY, 0);
    within(async {
        while server.attached("disk") != 1 {
            tokio::task::yield_now().await;
        }
    })
    .await;
}

#[tokio::test]
async fn go_to_unknown_export_is_an_error_not_a_hangup() {
    let (server, _, _) = server();
    let (s, _task) = pipe(&server);
    let mut c = Client::connect(s).await;
    assert_eq!(c.go("nope").await, Err(REP_ERR_UNKNOWN));
    let req = InfoRequest {
        name: "nope".into(),
        requests: vec![],
    };
    assert_eq!(
        c.option(OPT_INFO, &req.encode()).await[0].0,
        REP_ERR_UNKNOWN
    );
    // The default export ("") still works afterwards.
    assert_eq!(c.go("").await.unwrap().0, 1 << 20);
}

#[tokio::test]
async fn read_only_export_flags() {
    let (server, _, _) = server();
    let (s, _task) = pipe(&server);
    let (_c, size, flags) = Client::open(s, "ro").await;
    assert_eq!(size, 64 << 10);
    assert_ne!(flags & FLAG_READ_ONLY, 0);
    assert_ne!(flags & FLAG_SEND_DF, 0);
    for f in [FLAG_SEND_TRIM, FLAG_SEND_WRITE_ZEROES, FLAG_SEND_FAST_ZERO] {
        assert_eq!(flags & f, 0, "read-only export advertises {f:#x}");
    }
}

#[tokio::test]
async fn export_name_with_and_without_zeroes() {
    use tokio::io::AsyncReadExt;
    for no_zeroes in [true, false] {
        let (server, _, _) = server();
        let (s, _task) = pipe(&server);
        let flags = FLAG_C_FIXED_NEWSTYLE | if no_zeroes { FLAG_C_NO_ZEROES } else { 0 };
        let mut c = Client::greet(s, flags).await.unwrap();
        c.send_option(OPT_EXPORT_NAME, b"disk").await.unwrap();
        let mut reply = vec![0u8; if no_zeroes { 10 } else { 134 }];
        c.s.read_exact(&mut reply).await.unwrap();
        assert_eq!(u64::from_be_bytes(reply[..8].try_into().unwrap()), 1 << 20);
        assert!(reply[10..].iter().all(|b| *b == 0));
        // Transmission works right after.
        let r = c.call(CMD_READ, 0, 0, 16, &[]).await;
        assert_eq!(Client::<tokio::io::DuplexStream>::errno_of(&r), 0);
    }
}

#[tokio::test]
async fn export_name_unknown_closes() {
    let (server, _, _) = server();
    let (s, task) = pipe(&server);
    let mut c = Client::connect(s).await;
    c.send_option(OPT_EXPORT_NAME, b"nope").await.unwrap();
    c.expect_closed().await;
    within(task).await.unwrap();
}

#[tokio::test]
async fn unsupported_and_refused_options() {
    let (server, _, _) = server();
    let (s, _task) = pipe(&server);
    let mut c = Client::connect(s).await;
    assert_eq!(c.option(OPT_STARTTLS, &[]).await[0].0, REP_ERR_POLICY);
    assert_eq!(c.option(OPT_STARTTLS, b"x").await[0].0, REP_ERR_INVALID);
    assert_eq!(
        c.option(OPT_EXTENDED_HEADERS, &[]).await[0].0,
        REP_ERR_UNSUP
    );
    assert_eq!(c.option(OPT_PEEK_EXPORT, &[]).await[0].0, REP_ERR_UNSUP);
    assert_eq!(c.option(0xdead_beef, b"junk").await[0].0, REP_ERR_UNSUP);
    assert_eq!(
        c.option(OPT_STRUCTURED_REPLY, b"x").await[0].0,
        REP_ERR_INVALID
    );
    // Still usable.
    assert!(c.go("disk").await.is_ok());
}

#[tokio::test]
async fn malformed_info_payloads_are_invalid() {
    let (server, _, _) = server();
    let (s, _task) = pipe(&server);
    let mut c = Client::connect(s).await;
    let good = InfoRequest {
        name: "disk".into(),
        requests: vec![INFO_BLOCK_SIZE],
    }
    .encode();
    let mut cases: Vec<Vec<u8>> = (0..good.len()).map(|n| good[..n].to_vec()).collect();
    let mut trailing = good.clone();
    trailing.push(0);
    cases.push(trailing);
    let mut huge_name = good.clone();
    huge_name[..4].copy_from_slice(&u32::MAX.to_be_bytes());
    cases.push(huge_name);
    let mut bad_utf8 = good.clone();
    bad_utf8[4] = 0xff;
    cases.push(bad_utf8);
    for case in cases {
        for opt in [OPT_INFO, OPT_GO] {
            let r = c.option(opt, &case).await;
            assert_eq!(r, vec![(r[0].0, r[0].1.clone())]);
            assert_eq!(r[0].0, REP_ERR_INVALID, "payload {case:?}");
        }
    }
    assert!(c.go("disk").await.is_ok());
}

#[tokio::test]
async fn meta_contexts() {
    let (server, _, _) = server();
    let (s, _task) = pipe(&server);
    let mut c = Client::connect(s).await;
    // SET before structured replies: invalid.
    let r = c.set_meta("disk", &[META_BASE_ALLOCATION]).await;
    assert_eq!(r[0].0, REP_ERR_INVALID);
    // LIST works, with or without queries; `base:` is a wildcard there.
    for queries in [
        vec![],
        vec!["base:".to_owned()],
        vec![META_BASE_ALLOCATION.to_owned()],
    ] {
        let req = MetaRequest {
            export: "disk".into(),
            queries,
        };
        let r = c.option(OPT_LIST_META_CONTEXT, &req.encode()).await;
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].0, REP_META_CONTEXT);
        assert_eq!(parse_meta_context(&r[0].1).unwrap().1, META_BASE_ALLOCATION);
    }
    // Unknown namespaces select nothing (just ACK).
    let req = MetaRequest {
        export: "disk".into(),
        queries: vec!["qemu:dirty-bitmap:x".into(), "nocolon".into()],
    };
    assert_eq!(
        c.option(OPT_LIST_META_CONTEXT, &req.encode()).await,
        vec![(REP_ACK, vec![])]
    );
    // Malformed payload.
    assert_eq!(
        c.option(OPT_LIST_META_CONTEXT, &[0, 0, 0, 9]).await[0].0,
        REP_ERR_INVALID
    );
    c.structured().await;
    // SET with `base:` selects nothing; with the full name, one context.
    let r = c.set_meta("disk", &["base:"]).await;
    assert_eq!(r, vec![(REP_ACK, vec![])]);
    let r = c
        .set_meta("disk", &[META_BASE_ALLOCATION, META_BASE_ALLOCATION])
        .await;
    assert_eq!(r.len(), 2);
    let (id, name) = parse_meta_context(&r[0].1).unwrap();
    assert_eq!(name, META_BASE_ALLOCATION);
    assert_ne!(id, 0);
    assert!(c.go("disk").await.is_ok());
    // Block status works with the negotiated context id.
    let r = c.call(CMD_BLOCK_STATUS, 0, 0, 8192, &[]).await;
    let Reply::Chunk { header, payload } = r else {
        panic!("expected a chunk")
    };
    assert_eq!(header.kind, REPLY_TYPE_BLOCK_STATUS);
    assert_eq!(parse_block_status_chunk(&payload).unwrap().0, id);
}

#[tokio::test]
async fn meta_context_for_another_export_is_not_active() {
    let (server, _, _) = server();
    let (s, _task) = pipe(&server);
    let mut c = Client::connect(s).await;
    c.structured().await;
    c.set_meta("ro", &[META_BASE_ALLOCATION]).await;
    c.go("disk").await.unwrap();
    let r = c.call(CMD_BLOCK_STATUS, 0, 0, 512, &[]).await;
    assert_eq!(Client::<tokio::io::DuplexStream>::errno_of(&r), 22);
}

#[tokio::test]
async fn unknown_client_flags_close() {
    let (server, _, _) = server();
    let (s, task) = pipe(&server);
    let mut c = Client::greet(s, FLAG_C_FIXED_NEWSTYLE | 1 << 7)
        .await
        .unwrap();
    c.expect_closed().await;
    within(task).await.unwrap();
}

#[tokio::test]
async fn bad_option_magic_closes() {
    let (server, _, _) = server();
    let (s, task) = pipe(&server);
    let mut c = Client::connect(s).await;
    c.s.write_all(b"IHAVEOPX\0\0\0\x03\0\0\0\0").await.unwrap();
    c.expect_closed().await;
    within(task).await.unwrap();
}

#[tokio::test]
async fn oversized_option_closes() {
    let (server, _, _) = server();
    let (s, task) = pipe(&server);
    let mut c = Client::connect(s).await;
    let h = OptionHeader {
        option: OPT_GO,
        length: (64 << 10) + 1,
    };
    c.s.write_all(&h.encode()).await.unwrap();
    c.expect_closed().await;
    within(task).await.unwrap();
}

#[tokio::test]
async fn abort_with_data_is_acked() {
    let (server, _, _) = server();
    let (s, task) = pipe(&server);
    let mut c = Client::connect(s).await;
    assert_eq!(
        c.option(OPT_ABORT, b"ignored").await,
        vec![(REP_ACK, vec![])]
    );
    c.expect_closed().await;
    within(task).await.unwrap();
    assert_eq!(server.connections(), 0);
}

#[tokio::test]
async fn options_after_shutdown_get_err_shutdown() {
    let (server, _, _) = server();
    let (s, task) = pipe(&server);
    let mut c = Client::connect(s).await;
    assert_eq!(c.option(OPT_LIST, &[]).await.last().unwrap().0, REP_ACK);
    server.shutdown();
    // Either the reply or a hang-up, never a hang.
    let _ = within(c.send_option(OPT_LIST, &[])).await;
    if let Ok(Ok((h, _))) =
        tokio::time::timeout(std::time::Duration::from_secs(10), c.option_reply()).await
    {
        assert_eq!(h.reply, REP_ERR_SHUTDOWN);
    }
    within(task).await.unwrap();
    within(server.wait_idle()).await;
}

/// Past `max_connections`, a new client is refused with a reason it can
/// show (qemu prints "server reported: ..."), not left to hold more threads;
/// once a connection ends, the next client is served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_server_refuses_new_clients_and_says_why() {
    let (server, _, _) = server_with(bulwark_nbd::ServerConfig {
        max_connections: 2,
        ..bulwark_nbd::ServerConfig::default()
    });
    let (s1, task1) = tokio::net::UnixStream::pipe(&server);
    let (mut c1, _, _) = Client::open(s1, "disk").await;
    let (s2, _task2) = tokio::net::UnixStream::pipe(&server);
    let (_c2, _, _) = Client::open(s2, "disk").await;

    let (s3, task3) = tokio::net::UnixStream::pipe(&server);
    let mut c3 = Client::connect(s3).await;
    // Structured replies refused, the client goes on; GO refused too.
    assert_eq!(
        c3.option(OPT_STRUCTURED_REPLY, &[]).await[0].0,
        REP_ERR_POLICY
    );
    let go = InfoRequest {
        name: "disk".into(),
        requests: vec![],
    };
    let replies = c3.option(OPT_GO, &go.encode()).await;
    let (reply, message) = replies.last().unwrap();
    assert_eq!(*reply, REP_ERR_POLICY);
    let message = String::from_utf8_lossy(message);
    assert!(
        message.contains("too many connections") && message.contains("at most 2"),
        "{message}"
    );
    assert_eq!(c3.option(OPT_ABORT, &[]).await, vec![(REP_ACK, vec![])]);
    within(task3).await.unwrap();

    c1.send(CMD_DISC, 0, 0, 0, &[]).await;
    within(task1).await.unwrap();
    let (s4, _task4) = tokio::net::UnixStream::pipe(&server);
    let mut c4 = Client::connect(s4).await;
    assert!(
        c4.go("disk").await.is_ok(),
        "refused after a connection ended"
    );
}
