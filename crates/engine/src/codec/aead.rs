//! AES-256-GCM for data blocks, from whichever of two libraries is faster on this CPU.
//!
//! Both compute the same standard AES-256-GCM (same key, nonce and associated data
//! give the same ciphertext and tag), so the choice changes speed, never the
//! on-disk format: a pool written with one opens with the other.
//!
//! - aws-lc-rs has an AVX-512 VAES path: the fastest measured on CPUs that have
//!   it (15–22 GB/s; ARCHITECTURE.md, "Dependencies and why").
//! - ring has a VAES + VPCLMULQDQ path on 256-bit AVX2 registers, which aws-lc
//!   (0.47) lacks: on a CPU with VAES but no AVX-512 (AMD Zen 3, measured here)
//!   aws-lc falls back to its AES-NI path at 3.3–3.9 GB/s, ring runs at
//!   6.1–6.9 GB/s (4 KiB and 64 KiB; `examples/aead_speed`, BENCHMARKS.md).
//!
//! `BULWARK_AEAD=aws-lc` or `=ring` overrides the choice (for measuring, and for
//! the tests that check both open what the other sealed).
//!
//! Key material: aws-lc keeps its key schedule in its own memory and cleanses it
//! when the key is dropped. ring does neither: its key is a plain value, built on
//! the stack and moved. Ours lives in a box that is zeroed before it is freed,
//! and the stack below the constructor's frame, where ring built it, is
//! overwritten right after (`scrub_stack`).

use std::mem::MaybeUninit;
use std::sync::OnceLock;

use zeroize::{Zeroize, Zeroizing};

use super::TAG_BYTES;
use crate::{Error, Result};

/// The library that runs AES-256-GCM for data blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AeadBackend {
    AwsLc,
    Ring,
}

impl AeadBackend {
    pub fn name(self) -> &'static str {
        match self {
            AeadBackend::AwsLc => "aws-lc",
            AeadBackend::Ring => "ring",
        }
    }

    /// The backend new ciphers use: `BULWARK_AEAD` if set, else what this CPU runs fastest.
    pub fn chosen() -> AeadBackend {
        static CHOSEN: OnceLock<AeadBackend> = OnceLock::new();
        *CHOSEN.get_or_init(|| match std::env::var("BULWARK_AEAD").as_deref() {
            Ok("aws-lc") => AeadBackend::AwsLc,
            Ok("ring") => AeadBackend::Ring,
            Ok(other) => {
                let auto = AeadBackend::for_this_cpu();
                tracing::warn!(
                    "BULWARK_AEAD={other:?} is not aws-lc or ring; using {}",
                    auto.name()
                );
                auto
            }
            Err(_) => AeadBackend::for_this_cpu(),
        })
    }

    /// aws-lc where it has its AVX-512 path; ring where the CPU has VAES with AVX2 only.
    fn for_this_cpu() -> AeadBackend {
        #[cfg(target_arch = "x86_64")]
        {
            let vaes = std::arch::is_x86_feature_detected!("vaes")
                && std::arch::is_x86_feature_detected!("vpclmulqdq");
            let avx512 = std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vl");
            if vaes && !avx512 && std::arch::is_x86_feature_detected!("avx2") {
                return AeadBackend::Ring;
            }
        }
        AeadBackend::AwsLc
    }
}

/// A volume's block cipher, derived from its data key.
pub struct BlockCipher {
    key: Key,
}

enum Key {
    AwsLc(aws_lc_rs::aead::LessSafeKey),
    Ring(RingKey),
}

/// ring's key, in a box that is zeroed before it is freed. ring's key type owns no
/// heap memory and has no destructor (asserted below), so zeroing its bytes in place
/// and freeing the box without dropping it is all there is to do.
struct RingKey(Box<MaybeUninit<ring::aead::LessSafeKey>>);

const _: () = assert!(!std::mem::needs_drop::<ring::aead::LessSafeKey>());

impl RingKey {
    fn get(&self) -> &ring::aead::LessSafeKey {
        // SAFETY: initialised in `ring_key`, and only zeroed in `drop`.
        unsafe { self.0.assume_init_ref() }
    }
}

impl Drop for RingKey {
    fn drop(&mut self) {
        let len = std::mem::size_of::<ring::aead::LessSafeKey>();
        // SAFETY: the box holds `len` bytes we own; MaybeUninit may hold any bytes, and
        // nothing reads the key after this.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr().cast::<u8>(), len) };
        bytes.zeroize();
    }
}

/// ring's key for `data_key`, built in a frame of its own (so `scrub_stack` reaches
/// the copies its construction leaves behind).
#[inline(never)]
fn ring_key(data_key: &Zeroizing<[u8; 32]>) -> RingKey {
    use ring::aead::{LessSafeKey, UnboundKey, AES_256_GCM};
    let unbound = UnboundKey::new(&AES_256_GCM, &data_key[..]).expect("AES-256 key is 32 bytes");
    RingKey(Box::new(MaybeUninit::new(LessSafeKey::new(unbound))))
}

/// Overwrites the stack below the caller's frame, where `ring_key` and ring's
/// constructors ran and left copies of the key schedule. Runs once per key load.
#[inline(never)]
fn scrub_stack() {
    let mut area = [0u8; 16 << 10];
    area.zeroize();
    std::hint::black_box(&area);
}

/// Format 1's nonce: 4 zero bytes, then the 64-bit counter little-endian.
fn nonce_bytes(counter: u64) -> [u8; 12] {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&counter.to_le_bytes());
    n
}

fn sealing_failed() -> Error {
    Error::Invalid("encryption failed".into())
}

/// The tag did not match: what was decrypted is not authentic.
pub struct TagMismatch;

impl BlockCipher {
    pub fn new(data_key: &Zeroizing<[u8; 32]>) -> BlockCipher {
        BlockCipher::with_backend(data_key, AeadBackend::chosen())
    }

    pub fn with_backend(data_key: &Zeroizing<[u8; 32]>, backend: AeadBackend) -> BlockCipher {
        let key = match backend {
            AeadBackend::AwsLc => {
                use aws_lc_rs::aead::{LessSafeKey, UnboundKey, AES_256_GCM};
                let unbound =
                    UnboundKey::new(&AES_256_GCM, &data_key[..]).expect("AES-256 key is 32 bytes");
                Key::AwsLc(LessSafeKey::new(unbound))
            }
            AeadBackend::Ring => {
                let key = Key::Ring(ring_key(data_key));
                scrub_stack();
                key
            }
        };
        BlockCipher { key }
    }

    pub fn backend(&self) -> AeadBackend {
        match self.key {
            Key::AwsLc(_) => AeadBackend::AwsLc,
            Key::Ring(_) => AeadBackend::Ring,
        }
    }

    /// Encrypts into `body` (as long as the plaintext) and writes the tag to `tag`. The
    /// plaintext is `plain` when given (read straight from it), else `body` itself.
    pub fn seal(
        &self,
        nonce: u64,
        aad: &[u8],
        plain: Option<&[u8]>,
        body: &mut [u8],
        tag: &mut [u8],
    ) -> Result<()> {
        self.seal96(nonce_bytes(nonce), aad, plain, body, tag)
    }

    /// `seal` with the whole 12-byte nonce given (format 2 lays its counter out
    /// otherwise: `auth::n96`).
    pub fn seal96(
        &self,
        nonce: [u8; 12],
        aad: &[u8],
        plain: Option<&[u8]>,
        body: &mut [u8],
        tag: &mut [u8],
    ) -> Result<()> {
        match &self.key {
            Key::AwsLc(k) => {
                use aws_lc_rs::aead::{Aad, Nonce};
                let n = Nonce::assume_unique_for_key(nonce);
                match plain {
                    Some(p) => k
                        .seal_out_of_place_scatter(n, Aad::from(aad), p, body, &[], tag)
                        .map_err(|_| sealing_failed()),
                    None => {
                        let t = k
                            .seal_in_place_separate_tag(n, Aad::from(aad), body)
                            .map_err(|_| sealing_failed())?;
                        tag.copy_from_slice(t.as_ref());
                        Ok(())
                    }
                }
            }
            Key::Ring(k) => {
                use ring::aead::{Aad, Nonce};
                // ring encrypts in place only: the copy runs from cache, at memcpy speed.
                if let Some(p) = plain {
                    body.copy_from_slice(p);
                }
                let t = k
                    .get()
                    .seal_in_place_separate_tag(
                        Nonce::assume_unique_for_key(nonce),
                        Aad::from(aad),
                        body,
                    )
                    .map_err(|_| sealing_failed())?;
                tag.copy_from_slice(t.as_ref());
                Ok(())
            }
        }
    }

    /// Decrypts `body` with `tag` into `out` (as long as `body`). On a tag mismatch `out`
    /// is zeroed: nobody may see bytes that did not authenticate.
    pub fn open_into(
        &self,
        nonce: u64,
        aad: &[u8],
        body: &[u8],
        tag: &[u8],
        out: &mut [u8],
    ) -> std::result::Result<(), TagMismatch> {
        self.open_into96(nonce_bytes(nonce), aad, body, tag, out)
    }

    /// `open_into` with the whole 12-byte nonce given.
    pub fn open_into96(
        &self,
        nonce: [u8; 12],
        aad: &[u8],
        body: &[u8],
        tag: &[u8],
        out: &mut [u8],
    ) -> std::result::Result<(), TagMismatch> {
        let ok = match &self.key {
            Key::AwsLc(k) => {
                use aws_lc_rs::aead::{Aad, Nonce};
                k.open_separate_gather(
                    Nonce::assume_unique_for_key(nonce),
                    Aad::from(aad),
                    body,
                    tag,
                    out,
                )
                .is_ok()
            }
            Key::Ring(_) => {
                // ring opens in place only (and `open_in_place` zeroes `out` on a mismatch).
                out.copy_from_slice(body);
                return self.open_in_place96(nonce, aad, out, tag);
            }
        };
        if ok {
            Ok(())
        } else {
            out.fill(0);
            Err(TagMismatch)
        }
    }

    /// Decrypts `body` in place with `tag`. On a tag mismatch `body` holds no plaintext.
    pub fn open_in_place(
        &self,
        nonce: u64,
        aad: &[u8],
        body: &mut [u8],
        tag: &[u8],
    ) -> std::result::Result<(), TagMismatch> {
        self.open_in_place96(nonce_bytes(nonce), aad, body, tag)
    }

    /// `open_in_place` with the whole 12-byte nonce given.
    pub fn open_in_place96(
        &self,
        nonce: [u8; 12],
        aad: &[u8],
        body: &mut [u8],
        tag: &[u8],
    ) -> std::result::Result<(), TagMismatch> {
        if tag.len() != TAG_BYTES {
            return Err(TagMismatch);
        }
        let ok = match &self.key {
            Key::AwsLc(k) => {
                use aws_lc_rs::aead::{Aad, Nonce};
                k.open_in_place_separate_tag(
                    Nonce::assume_unique_for_key(nonce),
                    Aad::from(aad),
                    tag,
                    body,
                )
                .is_ok()
            }
            Key::Ring(k) => {
                use ring::aead::{Aad, Nonce, Tag};
                let tag = Tag::try_from(tag).map_err(|_| TagMismatch)?;
                k.get()
                    .open_in_place_separate_tag(
                        Nonce::assume_unique_for_key(nonce),
                        Aad::from(aad),
                        tag,
                        body,
                        0..,
                    )
                    .is_ok()
            }
        };
        if ok {
            Ok(())
        } else {
            body.fill(0);
            Err(TagMismatch)
        }
    }
}
