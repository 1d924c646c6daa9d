//! The engine's environment: the clock, sleeping and randomness, given to the engine
//! rather than reached for (issue 37 point 1).
//!
//! Every read of the clock (`now`, `since`, `unix_secs`, `system_time`), every sleep
//! (`sleep`) and every random byte (`fill`, `random`) in the engine goes through this
//! file; the layer test `the_environment_comes_through_env` fails on a direct
//! `Instant::now`, `SystemTime::now`, `.elapsed()`, `thread::sleep` or
//! `aws_lc_rs::rand` anywhere else in the engine's non-test code.
//!
//! In production these are the operating system's clock and random source. A
//! simulator (`bulwark-sim`) installs a **simulated environment on its own thread**
//! (`simulate(seed)`): random bytes come from a keyed BLAKE3 stream of the seed, the
//! clock starts at a fixed date and moves only when the simulator advances it
//! (`advance`) or the engine sleeps (a sleep moves the clock and returns at once). The
//! same seed then writes the same bytes to the same places: nonces, salts, keys, ids and
//! timestamps included, so a run's layout (and so which I/O a seeded fault hits) is the
//! same every time.
//!
//! The override is per thread and lives only while the guard does: threads the engine
//! starts (the maintenance loop, device syncers) see the real environment, which is why
//! the simulator drives the engine in stepped mode, without them. Keys made under a
//! simulated environment are as secret as the seed: nothing but a simulator installs one.

use std::cell::RefCell;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Where a simulated clock starts: 2027-01-15 08:00:00 UTC (any fixed date serves).
const SIMULATED_EPOCH_SECS: u64 = 1_800_000_000;

struct Simulated {
    key: [u8; 32],
    drawn: u64,
    base: Instant,
    elapsed: Duration,
}

thread_local! {
    static SIMULATED: RefCell<Option<Simulated>> = const { RefCell::new(None) };
}

fn with_simulated<T>(f: impl FnOnce(&mut Simulated) -> T) -> Option<T> {
    SIMULATED.with(|s| s.borrow_mut().as_mut().map(f))
}

/// While this lives, this thread's clock and randomness are simulated (see the module
/// docs); dropping it gives the thread the real ones back.
pub struct SimulatedEnv {
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for SimulatedEnv {
    fn drop(&mut self) {
        SIMULATED.with(|s| *s.borrow_mut() = None);
    }
}

/// Installs a simulated environment on this thread, seeded by `seed` (replacing any
/// installed before).
pub fn simulate(seed: u64) -> SimulatedEnv {
    let key = *blake3::Hasher::new_derive_key("bulwark simulated environment v1")
        .update(&seed.to_le_bytes())
        .finalize()
        .as_bytes();
    SIMULATED.with(|s| {
        *s.borrow_mut() = Some(Simulated {
            key,
            drawn: 0,
            base: Instant::now(),
            elapsed: Duration::ZERO,
        })
    });
    SimulatedEnv {
        _not_send: std::marker::PhantomData,
    }
}

/// Moves this thread's simulated clock on by `d` (nothing without one).
pub fn advance(d: Duration) {
    with_simulated(|s| s.elapsed += d);
}

/// Whether this thread runs in a simulated environment.
pub fn is_simulated() -> bool {
    with_simulated(|_| ()).is_some()
}

/// The monotonic clock.
pub fn now() -> Instant {
    with_simulated(|s| s.base + s.elapsed).unwrap_or_else(Instant::now)
}

/// How long since `t` (an instant from `now`), never negative.
pub fn since(t: Instant) -> Duration {
    now().saturating_duration_since(t)
}

/// The wall clock.
pub fn system_time() -> SystemTime {
    with_simulated(|s| UNIX_EPOCH + Duration::from_secs(SIMULATED_EPOCH_SECS) + s.elapsed)
        .unwrap_or_else(SystemTime::now)
}

/// The wall clock in whole seconds since 1970 (0 for a clock set before it).
pub fn unix_secs() -> u64 {
    system_time()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Sleeps for `d`; in a simulated environment, moves the clock by `d` and returns.
pub fn sleep(d: Duration) {
    if with_simulated(|s| s.elapsed += d).is_none() {
        std::thread::sleep(d);
    }
}

/// Fills `buf` with random bytes: the system's random source, or the seed's stream.
pub fn fill(buf: &mut [u8]) {
    let simulated = with_simulated(|s| {
        let mut h = blake3::Hasher::new_keyed(&s.key);
        h.update(&s.drawn.to_le_bytes());
        s.drawn += 1;
        h.finalize_xof().fill(buf);
    });
    if simulated.is_none() {
        aws_lc_rs::rand::fill(buf).expect("system random source");
    }
}

/// `N` random bytes (`fill`).
pub fn random<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    fill(&mut b);
    b
}

/// A job of `run_jobs`.
pub type Job<'a, T> = Box<dyn FnOnce() -> T + Send + 'a>;

/// Runs `jobs` at once, each on a scoped thread of its own; in a simulated environment,
/// one after another on this thread. A thread the engine starts sees the real clock, not
/// this thread's simulated one (the override is per thread), and the order its calls reach
/// a simulated store in is not the seed's: an object-tier commit's upload budget, read on
/// such a thread, compared the real clock with a simulated instant, and a simulator run
/// on a busy machine failed with "took more than 60 s for one commit" at an operation
/// that changed from run to run. Results come back in the jobs' order; a job's panic is
/// the caller's.
pub fn run_jobs<'a, T: Send + 'a>(jobs: Vec<Job<'a, T>>) -> Vec<T> {
    if is_simulated() {
        return jobs.into_iter().map(|j| j()).collect();
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = jobs.into_iter().map(|j| s.spawn(j)).collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Under a simulated environment the jobs run on this thread and read its clock; in
    /// the real one they run on threads of their own.
    #[test]
    fn jobs_of_a_simulated_thread_run_on_it() {
        let on_threads = || {
            let me = std::thread::current().id();
            let jobs: Vec<Job<'_, (bool, Instant)>> = (0..3)
                .map(|_| Box::new(move || (std::thread::current().id() == me, now())) as Job<'_, _>)
                .collect();
            run_jobs(jobs)
        };
        let _env = simulate(1);
        advance(Duration::from_secs(5));
        let at = now();
        let got = on_threads();
        assert!(got.iter().all(|&(here, t)| here && t == at), "simulated");
        drop(_env);
        assert!(on_threads().iter().all(|&(here, _)| !here), "real");
    }

    #[test]
    fn a_seed_gives_the_same_bytes_and_times_and_the_real_environment_comes_back() {
        let draw = |seed| {
            let _env = simulate(seed);
            let a: [u8; 32] = random();
            let before = now();
            sleep(Duration::from_secs(3600));
            advance(Duration::from_secs(1));
            (a, random::<7>(), since(before), unix_secs())
        };
        let one = draw(5);
        assert_eq!(one, draw(5));
        assert_ne!(one.0, draw(6).0);
        assert_ne!(one.0[..7], one.1[..]);
        assert_eq!(one.2, Duration::from_secs(3601));
        assert_eq!(one.3, SIMULATED_EPOCH_SECS + 3601);
        // The guard is gone: real randomness and the real clock again.
        assert!(!is_simulated());
        assert_ne!(random::<32>(), random::<32>());
        assert!(unix_secs() > 1_700_000_000 && unix_secs() != SIMULATED_EPOCH_SECS + 3601);
    }
}
