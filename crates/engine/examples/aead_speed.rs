//! AES-256-GCM speed of both data-block backends on this CPU, and which one the
//! engine picks (`codec::AeadBackend::chosen`).
//!
//!     cargo run --release -p bulwark-engine --example aead_speed
//!
//! Seals 4 KiB and 64 KiB buffers in place through `BlockCipher::seal` for about
//! half a second per cell, best of three; prints MB/s (10^6 bytes per second).

use std::time::{Duration, Instant};

use bulwark_engine::codec::{AeadBackend, BlockCipher};
use zeroize::Zeroizing;

fn mb_per_s(cipher: &BlockCipher, len: usize) -> f64 {
    let mut body = vec![0x5au8; len];
    let mut tag = [0u8; 16];
    let mut best = 0f64;
    let mut nonce = 0u64;
    for _ in 0..3 {
        let start = Instant::now();
        let mut bytes = 0usize;
        while start.elapsed() < Duration::from_millis(500) {
            for _ in 0..64 {
                cipher
                    .seal(nonce, &[1u8; 24], None, &mut body, &mut tag)
                    .expect("seal");
                nonce += 1;
                bytes += len;
            }
        }
        best = best.max(bytes as f64 / start.elapsed().as_secs_f64() / 1e6);
    }
    best
}

fn main() {
    let key = Zeroizing::new([7u8; 32]);
    println!("chosen on this CPU: {}", AeadBackend::chosen().name());
    for backend in [AeadBackend::AwsLc, AeadBackend::Ring] {
        let cipher = BlockCipher::with_backend(&key, backend);
        println!(
            "{:7} 4 KiB: {:6.0} MB/s   64 KiB: {:6.0} MB/s",
            backend.name(),
            mb_per_s(&cipher, 4096),
            mb_per_s(&cipher, 65536)
        );
    }
}
