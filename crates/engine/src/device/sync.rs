//! Devices synced side by side, on threads kept for it.
//!
//! A FLUSH of a mirror syncs every member at once: one `fdatasync` each, and the slowest
//! sets the pace. A thread made for each flush costs about a dozen system calls (stack,
//! guard page, signal stack, ...), a tenth of a flush at queue depth 1; so the threads
//! are made once, on first need, and wait for work between flushes. They hold a device
//! only while they sync it (a pool that closes releases its devices at once), and end
//! when their `Syncers` is dropped.

use std::sync::{mpsc, Arc, Mutex};

use super::Device;

/// One sync for a kept thread: the device, its place in the caller's list, and where the
/// result goes.
type Job = (
    Arc<dyn Device>,
    usize,
    mpsc::Sender<(usize, std::io::Result<()>)>,
);

#[derive(Default)]
pub struct Syncers {
    workers: Mutex<Vec<mpsc::Sender<Job>>>,
}

impl Syncers {
    /// Syncs every device in `devs`: the first on the caller's thread, the others on kept
    /// threads meanwhile. Results in `devs`' order. A thread that cannot be made (a thread
    /// limit) or has gone is no reason to fail: its device is synced here, after the first.
    pub fn flush_all(&self, devs: &[Arc<dyn Device>]) -> Vec<std::io::Result<()>> {
        let Some((first, rest)) = devs.split_first() else {
            return Vec::new();
        };
        if rest.is_empty() {
            return vec![first.flush()];
        }
        let senders = self.senders(rest.len());
        let (reply, results) = mpsc::channel();
        let mut inline = Vec::new();
        let mut sent = 0;
        for (i, dev) in rest.iter().enumerate() {
            let job = (dev.clone(), i + 1, reply.clone());
            match senders.get(i).map(|s| s.send(job)) {
                Some(Ok(())) => sent += 1,
                _ => inline.push(i + 1),
            }
        }
        drop(reply);
        let mut out: Vec<Option<std::io::Result<()>>> = (0..devs.len()).map(|_| None).collect();
        out[0] = Some(first.flush());
        for i in inline {
            out[i] = Some(devs[i].flush());
        }
        for _ in 0..sent {
            match results.recv() {
                Ok((i, r)) => out[i] = Some(r),
                // Every sender is gone: a thread ended without answering (it cannot panic
                // in a flush, but the results must not be invented).
                Err(_) => break,
            }
        }
        out.into_iter()
            .enumerate()
            .map(|(i, r)| r.unwrap_or_else(|| devs[i].flush()))
            .collect()
    }

    /// Senders to `n` kept threads (fewer if no more can be made).
    fn senders(&self, n: usize) -> Vec<mpsc::Sender<Job>> {
        let mut workers = self.workers.lock().unwrap_or_else(|p| p.into_inner());
        while workers.len() < n {
            let (tx, rx) = mpsc::channel::<Job>();
            let made = std::thread::Builder::new()
                .name("bulwark-sync".into())
                .spawn(move || {
                    while let Ok((dev, i, reply)) = rx.recv() {
                        let r = dev.flush();
                        // The device is let go before the answer: the caller may close it.
                        drop(dev);
                        let _ = reply.send((i, r));
                    }
                });
            if made.is_err() {
                break;
            }
            workers.push(tx);
        }
        workers.iter().take(n).cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::FileDevice;

    #[test]
    fn every_device_is_synced_and_let_go() {
        let t = tempfile::tempdir().unwrap();
        let devs: Vec<Arc<dyn Device>> = (0..4)
            .map(|i| {
                Arc::new(
                    FileDevice::create_sparse(&t.path().join(format!("d{i}")), 1 << 20).unwrap(),
                ) as Arc<dyn Device>
            })
            .collect();
        let syncers = Syncers::default();
        for _ in 0..3 {
            let r = syncers.flush_all(&devs);
            assert_eq!(r.len(), 4);
            assert!(r.iter().all(|r| r.is_ok()));
        }
        // Three threads kept (the first device is synced by the caller), none holding a
        // device once the call returned.
        assert_eq!(syncers.workers.lock().unwrap().len(), 3);
        assert!(devs.iter().all(|d| Arc::strong_count(d) == 1));
        assert!(syncers.flush_all(&[]).is_empty());
    }
}
