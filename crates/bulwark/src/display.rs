//! Human output: `volume list` as `zfs list` prints, `status` as `zpool status` does.
//!
//! Pure functions from protocol results to text, so they can be tested
//! without a daemon. Sizes use `bulwark_engine::size::format_size` (1.50G).

use std::fmt::Write as _;

use bulwark_engine::size::format_size;
use bulwark_engine::VolumeStatus;

use crate::control::{KeyStatus, StatusReport, VolumeEntry};

#[derive(Clone, Copy, PartialEq, Eq)]
enum Align {
    Left,
    Right,
}

/// Columns padded to their widest cell, separated by two spaces, no trailing blanks.
struct Table {
    headers: Vec<&'static str>,
    align: Vec<Align>,
    rows: Vec<Vec<String>>,
}

impl Table {
    fn new(columns: &[(&'static str, Align)]) -> Table {
        Table {
            headers: columns.iter().map(|c| c.0).collect(),
            align: columns.iter().map(|c| c.1).collect(),
            rows: Vec::new(),
        }
    }

    fn row(&mut self, cells: Vec<String>) {
        assert_eq!(cells.len(), self.headers.len());
        self.rows.push(cells);
    }

    fn render(&self, indent: &str) -> String {
        let mut widths: Vec<usize> = self.headers.iter().map(|h| h.len()).collect();
        for row in &self.rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let mut out = String::new();
        let header: Vec<String> = self.headers.iter().map(|h| h.to_string()).collect();
        for row in std::iter::once(&header).chain(&self.rows) {
            let mut line = String::from(indent);
            for (i, cell) in row.iter().enumerate() {
                if i > 0 {
                    line.push_str("  ");
                }
                let pad = widths[i] - cell.chars().count();
                match self.align[i] {
                    Align::Left => {
                        line.push_str(cell);
                        line.extend(std::iter::repeat_n(' ', pad));
                    }
                    Align::Right => {
                        line.extend(std::iter::repeat_n(' ', pad));
                        line.push_str(cell);
                    }
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

fn on_off(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}

/// `volume list`: NAME SIZE USED BLOCKSIZE COMPRESS ENCRYPTION KEYSTATUS.
pub fn volume_table(volumes: &[VolumeEntry]) -> String {
    if volumes.is_empty() {
        return "no volumes\n".to_string();
    }
    use Align::*;
    let mut t = Table::new(&[
        ("NAME", Left),
        ("SIZE", Right),
        ("USED", Right),
        ("BLOCKSIZE", Right),
        ("COMPRESS", Left),
        ("ENCRYPTION", Left),
        ("KEYSTATUS", Left),
    ]);
    for v in volumes {
        let s = &v.volume;
        t.row(vec![
            s.name.clone(),
            format_size(s.size_bytes),
            format_size(s.used_bytes),
            format_size(s.block_size as u64),
            s.compression.clone(),
            on_off(s.encryption).to_string(),
            v.key_status.as_str().to_string(),
        ]);
    }
    t.render("")
}

/// `volume create`: one line about the new volume.
pub fn volume_created(v: &VolumeStatus) -> String {
    let key = match KeyStatus::of(v) {
        KeyStatus::Available => ", key loaded",
        KeyStatus::Unavailable => ", locked",
        KeyStatus::None => "",
    };
    format!(
        "created volume {}: {}, block size {}, compression {}, encryption {}{}\n",
        v.name,
        format_size(v.size_bytes),
        format_size(v.block_size as u64),
        v.compression,
        on_off(v.encryption),
        key,
    )
}

/// `status`: pool header, device table, repair counters, space, volumes, errors.
pub fn status_text(report: &StatusReport) -> String {
    let p = &report.pool;
    let d = &report.daemon;
    let mut out = String::new();
    let _ = writeln!(out, "  pool: {}", p.pool_id);
    let _ = writeln!(out, "   dir: {}", p.dir.display());
    let _ = writeln!(out, " state: {}", p.state);
    let _ = writeln!(out, "layout: {}", p.layout);
    let _ = writeln!(out, "   gen: {}", p.generation);
    let mut exports = format!("nbd+unix:///NAME?socket={}", d.nbd_socket.display());
    if let Some(tcp) = &d.nbd_tcp {
        let _ = write!(exports, ", nbd://{tcp}/NAME");
    }
    let _ = writeln!(out, "export: {exports}");
    let _ = writeln!(out, "config:\n");

    use Align::*;
    let mut t = Table::new(&[
        ("NAME", Left),
        ("STATE", Left),
        ("READ", Right),
        ("WRITE", Right),
        ("CKSUM", Right),
    ]);
    t.row(vec![
        p.layout.clone(),
        p.state.clone(),
        String::new(),
        String::new(),
        String::new(),
    ]);
    for dev in &p.devices {
        t.row(vec![
            format!("  {}", dev.path.display()),
            dev.state.clone(),
            dev.read_errors.to_string(),
            dev.write_errors.to_string(),
            dev.cksum_errors.to_string(),
        ]);
    }
    out.push_str(&t.render("\t"));
    out.push('\n');

    let _ = writeln!(out, "repaired blocks: {}", p.repaired_blocks);
    let _ = writeln!(out, "unrecoverable blocks: {}", p.unrecoverable_blocks);
    let _ = writeln!(
        out,
        "space: {} used, {} free, {} total",
        format_size(p.space.used_bytes),
        format_size(p.space.free_bytes),
        format_size(p.space.total_bytes),
    );
    out.push('\n');

    if p.volumes.is_empty() {
        let _ = writeln!(out, "volumes: none");
    } else {
        let _ = writeln!(out, "volumes:\n");
        let mut t = Table::new(&[
            ("NAME", Left),
            ("SIZE", Right),
            ("USED", Right),
            ("BLOCKSIZE", Right),
            ("COMPRESS", Left),
            ("ENCRYPTION", Left),
            ("KEY", Left),
            ("ATTACHED", Right),
        ]);
        for v in &p.volumes {
            let key = match KeyStatus::of(v) {
                KeyStatus::Available => "unlocked",
                KeyStatus::Unavailable => "LOCKED",
                KeyStatus::None => "-",
            };
            t.row(vec![
                v.name.clone(),
                format_size(v.size_bytes),
                format_size(v.used_bytes),
                format_size(v.block_size as u64),
                v.compression.clone(),
                on_off(v.encryption).to_string(),
                key.to_string(),
                d.attached.get(&v.name).copied().unwrap_or(0).to_string(),
            ]);
        }
        out.push_str(&t.render("\t"));
    }
    out.push('\n');

    if p.unrecoverable_blocks == 0 {
        let _ = writeln!(out, "errors: No known data errors");
    } else {
        let _ = writeln!(
            out,
            "errors: {} unrecoverable block(s): no copy verified; reads of them fail rather than return wrong data",
            p.unrecoverable_blocks
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::DaemonInfo;
    use bulwark_engine::{DeviceStatus, PoolStatus, SpaceStatus};

    fn vol(name: &str, encryption: bool, locked: bool) -> VolumeStatus {
        VolumeStatus {
            name: name.into(),
            size_bytes: 1 << 30,
            block_size: 4096,
            compression: "lz4".into(),
            encryption,
            locked,
            used_bytes: 3 << 19,
            ..Default::default()
        }
    }

    #[test]
    fn volume_table_aligns_columns() {
        let rows: Vec<VolumeEntry> = [
            vol("alpha", true, false),
            vol("b", true, true),
            vol("plain", false, false),
        ]
        .into_iter()
        .map(|v| VolumeEntry {
            key_status: KeyStatus::of(&v),
            volume: v,
            attached: 0,
        })
        .collect();
        let text = volume_table(&rows);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "NAME   SIZE   USED  BLOCKSIZE  COMPRESS  ENCRYPTION  KEYSTATUS"
        );
        assert_eq!(
            lines[1],
            "alpha    1G  1.50M         4K  lz4       on          available"
        );
        assert_eq!(
            lines[2],
            "b        1G  1.50M         4K  lz4       on          unavailable"
        );
        assert_eq!(
            lines[3],
            "plain    1G  1.50M         4K  lz4       off         none"
        );
    }

    #[test]
    fn status_reads_like_zpool() {
        let report = StatusReport {
            pool: PoolStatus {
                pool_id: "abc".into(),
                dir: "/p".into(),
                state: "ONLINE".into(),
                layout: "mirror:2".into(),
                generation: 7,
                devices: vec![
                    DeviceStatus {
                        path: "/p/dev0".into(),
                        state: "ONLINE".into(),
                        read_errors: 0,
                        write_errors: 0,
                        cksum_errors: 12,
                        size_bytes: 1 << 28,
                    },
                    DeviceStatus {
                        path: "/p/dev1".into(),
                        state: "ONLINE".into(),
                        read_errors: 0,
                        write_errors: 0,
                        cksum_errors: 0,
                        size_bytes: 1 << 28,
                    },
                ],
                repaired_blocks: 12,
                unrecoverable_blocks: 0,
                space: SpaceStatus {
                    total_bytes: 1 << 28,
                    used_bytes: 1 << 20,
                    free_bytes: 255 << 20,
                },
                volumes: vec![vol("v", true, true)],
                ..Default::default()
            },
            daemon: DaemonInfo {
                version: "0".into(),
                pid: 1,
                nbd_socket: "/p/nbd.sock".into(),
                nbd_tcp: None,
                attached: Default::default(),
            },
        };
        let text = status_text(&report);
        assert!(
            text.contains("\tNAME       STATE   READ  WRITE  CKSUM\n"),
            "{text}"
        );
        assert!(
            text.contains("\t  /p/dev0  ONLINE     0      0     12\n"),
            "{text}"
        );
        assert!(text.contains("repaired blocks: 12\n"));
        assert!(text.contains("space: 1M used, 255M free, 256M total\n"));
        assert!(text.contains("LOCKED"));
        assert!(text.ends_with("errors: No known data errors\n"));
    }
}
