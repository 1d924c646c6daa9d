//! A per-connection pool of blocking worker threads.
//!
//! Backend calls block, so they cannot run on the async reader. Handing each
//! request to tokio's shared blocking pool (`spawn_blocking`) costs a task
//! allocation, a trip through one global queue and, under load, one new or
//! woken thread per request in flight: at 4 KiB that hand-off, not the
//! backend, was the request path's cost. Here each connection runs a few
//! long-lived blocking tasks, started on demand up to `max`, that take jobs
//! from one queue and keep taking them while it is not empty, so a busy
//! connection pays no spawn and no wake-up per request, and no more threads
//! than `max`. They are threads of their own, not tasks of tokio's blocking
//! pool: that pool is bounded and shared with the handshake and the
//! embedding program (the daemon's control requests), and connections whose
//! requests wait on storage would hold its threads (with 4 per connection,
//! 128 busy connections took all 512). Only when the system refuses a new
//! thread does a worker fall back to the pool.
//!
//! Invariants:
//! - Every submitted job runs exactly once, even after [`Workers::close`]
//!   (closing stops new submissions; queued jobs still run, so each admitted
//!   request still gets its reply or has its permits released).
//! - [`Workers::join`] resolves only after every worker thread has finished
//!   its last job and dropped what it held (backend included).
//! - At most `max` threads per connection, and none once it has been idle
//!   for `WORKER_IDLE` (an idle connection holds no thread); the queue
//!   never holds more jobs
//!   than the connection's in-flight bound (the reader submits only with an
//!   in-flight permit).

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use tokio::sync::mpsc;
use tracing::debug;

use crate::limits::WORKER_IDLE;

/// One unit of blocking work.
pub(crate) type Job = Box<dyn FnOnce() + Send + 'static>;

struct Queue {
    jobs: VecDeque<Job>,
    /// Threads started and not yet exited.
    threads: usize,
    /// Threads waiting on the condvar.
    sleeping: usize,
    closed: bool,
}

struct State {
    queue: Mutex<Queue>,
    ready: Condvar,
}

impl State {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        // Jobs run outside the lock and catch their own panics; the queue
        // cannot be left half-updated.
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

pub(crate) struct Workers {
    state: Arc<State>,
    max: usize,
    /// Cloned into each thread and dropped when it exits.
    alive: Option<mpsc::Sender<()>>,
    exited: mpsc::Receiver<()>,
}

impl Workers {
    pub(crate) fn new(max: usize) -> Self {
        let (alive, exited) = mpsc::channel(1);
        Self {
            state: Arc::new(State {
                queue: Mutex::new(Queue {
                    jobs: VecDeque::new(),
                    threads: 0,
                    sleeping: 0,
                    closed: false,
                }),
                ready: Condvar::new(),
            }),
            max: max.max(1),
            alive: Some(alive),
            exited,
        }
    }

    /// Queues `job`; wakes a sleeping worker, and starts another thread when
    /// more jobs wait than workers sleep (up to `max`).
    pub(crate) fn submit(&self, job: Job) {
        let mut q = self.state.lock();
        q.jobs.push_back(job);
        if q.sleeping > 0 {
            self.state.ready.notify_one();
        }
        if q.jobs.len() > q.sleeping && q.threads < self.max {
            if let Some(alive) = &self.alive {
                let state = Arc::clone(&self.state);
                let alive = alive.clone();
                q.threads += 1;
                let (again, alive_again) = (Arc::clone(&state), alive.clone());
                let spawned = std::thread::Builder::new()
                    .name("nbd-worker".into())
                    .spawn(move || work(state, alive));
                if let Err(e) = spawned {
                    debug!("no thread for an NBD worker ({e}): using the blocking pool");
                    tokio::task::spawn_blocking(move || work(again, alive_again));
                }
            }
        }
    }

    /// Lets the threads exit once the queue is empty.
    pub(crate) fn close(&mut self) {
        self.state.lock().closed = true;
        self.state.ready.notify_all();
        self.alive = None;
    }

    /// Closes, then waits until every thread has exited.
    pub(crate) async fn join(mut self) {
        self.close();
        // `None` once every clone of `alive` is dropped.
        let _ = self.exited.recv().await;
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.close();
    }
}

fn work(state: Arc<State>, alive: mpsc::Sender<()>) {
    let mut q = state.lock();
    let mut idle_expired = false;
    loop {
        if let Some(job) = q.jobs.pop_front() {
            drop(q);
            job();
            q = state.lock();
            idle_expired = false;
            continue;
        }
        if q.closed || idle_expired {
            break;
        }
        q.sleeping += 1;
        let (guard, waited) = state
            .ready
            .wait_timeout(q, WORKER_IDLE)
            .unwrap_or_else(PoisonError::into_inner);
        q = guard;
        q.sleeping -= 1;
        idle_expired = waited.timed_out();
    }
    q.threads -= 1;
    drop(q);
    drop(alive);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_job_runs_and_join_waits_for_threads() {
        let workers = Workers::new(3);
        let ran = Arc::new(AtomicUsize::new(0));
        let token = Arc::new(());
        for _ in 0..200 {
            let ran = Arc::clone(&ran);
            let token = Arc::clone(&token);
            workers.submit(Box::new(move || {
                std::thread::sleep(std::time::Duration::from_micros(50));
                ran.fetch_add(1, Ordering::SeqCst);
                drop(token);
            }));
        }
        assert!(workers.state.lock().threads <= 3);
        workers.join().await;
        assert_eq!(ran.load(Ordering::SeqCst), 200);
        // Every job (and what it captured) is gone once join returns.
        assert_eq!(Arc::strong_count(&token), 1);
    }

    #[tokio::test]
    async fn join_without_jobs() {
        Workers::new(4).join().await;
    }
}
