//! Hostile input: seeded random bytes and random-but-framed messages in
//! both phases. The server must answer or hang up, never panic or hang,
//! and keep serving other connections. A failure names its seed; rerun one
//! seed with `NBD_FUZZ_SEED=<seed>`, more with `NBD_FUZZ_ROUNDS=<n>`.

mod common;

use std::time::Duration;

use bulwark_nbd::proto::*;
use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// xorshift64*: small, seeded, dependency-free.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
    /// Mostly small values, sometimes edge values.
    fn length(&mut self) -> u32 {
        match self.below(8) {
            0 => 0,
            1 => u32::MAX,
            2 => (64 << 10) + self.below(3) as u32,
            _ => self.below(70_000) as u32,
        }
    }
    fn offset(&mut self) -> u64 {
        match self.below(6) {
            0 => u64::MAX - self.below(10),
            1 => (1 << 20) - self.below(5000),
            _ => self.below(1 << 20),
        }
    }
}

/// Handshake-phase input for one seed.
fn handshake_garbage(rng: &mut Rng) -> Vec<u8> {
    let mut out = Vec::new();
    let flags: u32 = match rng.below(4) {
        0 => rng.next() as u32,
        _ => FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES,
    };
    out.extend_from_slice(&flags.to_be_bytes());
    for _ in 0..rng.below(12) {
        match rng.below(5) {
            0 => {
                let n = rng.below(64) as usize;
                out.extend(rng.bytes(n));
            }
            _ => {
                let option = match rng.below(3) {
                    0 => rng.next() as u32,
                    _ => rng.below(13) as u32,
                };
                // Half the INFO/GO options are well formed, so some
                // handshakes reach transmission and the rest of the
                // garbage lands there.
                let payload_len = rng.below(40) as usize;
                let mut payload = rng.bytes(payload_len);
                if (option == OPT_GO || option == OPT_INFO) && rng.below(2) == 0 {
                    payload = InfoRequest {
                        name: ["disk", "ro", "", "x"][rng.below(4) as usize].into(),
                        requests: vec![rng.next() as u16],
                    }
                    .encode();
                }
                let length = if rng.below(10) == 0 {
                    rng.next() as u32
                } else {
                    payload.len() as u32
                };
                out.extend_from_slice(&OptionHeader { option, length }.encode());
                out.extend(payload);
            }
        }
    }
    out
}

/// Transmission-phase input for one seed.
fn transmission_garbage(rng: &mut Rng) -> Vec<u8> {
    let mut out = Vec::new();
    for handle in 0..rng.below(40) {
        if rng.below(25) == 0 {
            let n = rng.below(40) as usize;
            out.extend(rng.bytes(n));
            continue;
        }
        let kind = match rng.below(10) {
            0 => rng.next() as u16,
            _ => rng.below(9) as u16,
        };
        let flags = match rng.below(3) {
            0 => rng.next() as u16,
            _ => rng.below(32) as u16,
        };
        let req = Request {
            flags,
            kind,
            handle,
            offset: rng.offset(),
            length: rng.length(),
        };
        out.extend_from_slice(&req.encode());
        if kind == CMD_WRITE && req.length <= 70_000 {
            // Usually the full payload, sometimes short (desync).
            let n = if rng.below(8) == 0 {
                rng.below(u64::from(req.length) + 1) as usize
            } else {
                req.length as usize
            };
            out.extend(vec![0xa5; n]);
        }
    }
    out
}

/// Feeds `input` to a fresh connection on the transmission path `P` picks
/// (after a prelude puts it in the right phase), drains whatever comes
/// back, closes, and checks that the server side finishes.
async fn feed<P: Pipe>(seed: u64, transmission: bool) {
    let (server, _, _) = server();
    let mut rng = Rng::new(seed);
    let (client, task) = P::pipe(&server);
    let input;
    let client = if transmission {
        let structured = rng.below(2) == 0;
        let mut c = Client::connect(client).await;
        if structured {
            c.structured().await;
            c.set_meta("disk", &[META_BASE_ALLOCATION]).await;
        }
        c.go(["disk", "ro"][rng.below(2) as usize]).await.unwrap();
        input = transmission_garbage(&mut rng);
        c.s
    } else {
        let mut client = client;
        let mut greeting = [0u8; GREETING_LEN];
        client.read_exact(&mut greeting).await.unwrap();
        input = handshake_garbage(&mut rng);
        client
    };
    let (mut rd, mut wr) = tokio::io::split(client);
    let drain = tokio::spawn(async move {
        let mut sink = vec![0u8; 64 << 10];
        while let Ok(n) = rd.read(&mut sink).await {
            if n == 0 {
                break;
            }
        }
    });
    // The server may hang up mid-way; that is fine.
    let _ = wr.write_all(&input).await;
    let _ = wr.shutdown().await;
    let done = tokio::time::timeout(Duration::from_secs(20), task).await;
    let joined = done.unwrap_or_else(|_| panic!("seed {seed}: server did not finish"));
    joined.unwrap_or_else(|e| panic!("seed {seed}: server task failed: {e}"));
    drop(wr);
    tokio::time::timeout(Duration::from_secs(20), drain)
        .await
        .unwrap_or_else(|_| panic!("seed {seed}: connection not closed"))
        .unwrap();
    assert_eq!(server.connections(), 0, "seed {seed}");
    assert_eq!(
        server.attached("disk") + server.attached("ro"),
        0,
        "seed {seed}"
    );

    // And the server still works.
    let (s, _task) = pipe(&server);
    let (mut c, _, _) = Client::open(s, "disk").await;
    let r = within(c.call(CMD_READ, 0, 0, 512, &[])).await;
    assert_eq!(
        Client::<tokio::io::DuplexStream>::errno_of(&r),
        0,
        "seed {seed}"
    );
}

fn seeds() -> Vec<u64> {
    if let Some(seed) = std::env::var("NBD_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        return vec![seed];
    }
    let rounds = std::env::var("NBD_FUZZ_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(150);
    (1..=rounds).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_handshake_input() {
    for seed in seeds() {
        feed::<tokio::io::DuplexStream>(seed, false).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_transmission_input() {
    for seed in seeds() {
        feed::<tokio::io::DuplexStream>(seed, true).await;
    }
}

/// The same inputs through a Unix socket: the threaded path (`direct.rs`)
/// that every Unix and plain TCP client gets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_transmission_input_on_a_socket() {
    for seed in seeds() {
        feed::<tokio::net::UnixStream>(seed, true).await;
    }
}
