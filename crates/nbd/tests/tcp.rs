//! Serving over TCP: the same protocol on a loopback socket, with
//! `TCP_NODELAY`, checked with the raw client and (if installed) qemu-io.

mod common;

use bulwark_nbd::proto::*;
use common::*;
use tokio::net::{TcpListener, TcpStream};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_round_trip_and_shutdown() {
    let (server, disk, _) = server();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let serving = tokio::spawn(server.clone().serve_tcp(listener));

    let (mut c, size, _) = Client::open(TcpStream::connect(addr).await.unwrap(), "disk").await;
    assert_eq!(size, 1 << 20);
    let r = c.call(CMD_WRITE, CMD_FLAG_FUA, 512, 4, b"abcd").await;
    assert_eq!(Client::<TcpStream>::errno_of(&r), 0);
    assert_eq!(&disk.data.lock().unwrap()[512..516], b"abcd");
    c.send(CMD_DISC, 0, 0, 0, &[]).await;
    c.expect_closed().await;

    let qemu_io = std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join("qemu-io").is_file()));
    if qemu_io {
        let out = tokio::process::Command::new("qemu-io")
            .args([
                "-f",
                "raw",
                &format!("nbd://{addr}/disk"),
                "-c",
                "read -P 0x61 512 1",
                "-c",
                "write -P 0x7 64k 64k",
            ])
            .output()
            .await
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success() && !text.contains("failed"), "{text}");
        assert!(disk.data.lock().unwrap()[65536..131072]
            .iter()
            .all(|b| *b == 7));
    } else {
        eprintln!("skipping the qemu-io part: qemu-io is not installed");
    }

    server.shutdown();
    within(serving).await.unwrap().unwrap();
    within(server.wait_idle()).await;
}
