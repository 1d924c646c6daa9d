//! CSI names and ids ↔ bulwark's volume and snapshot names.
//!
//! A volume's id is its bulwark name: the CSI name itself when it follows bulwark's
//! rules (1-64 letters, digits, `.`, `_`, `-`, not starting with `-` or `.`; the
//! external-provisioner's `pvc-UUID` does), else a name derived from it, the
//! sanitised first 47 characters, `-`, and 16 hex digits of the name's BLAKE3 hash
//! (CSI names reach 128 characters). The mapping is a pure function of the name, so
//! `CreateVolume` is idempotent by name with no table of its own (csi-driver-host-path
//! keeps one in memory; Ceph CSI in an omap); a snapshot's id is `VOLUME@SNAPSHOT`, its
//! name mapped the same way. Snapshots that a clone from a volume makes implicitly are
//! named `csi-clone-` and a hash of the clone's name, and are never listed.

/// Longest bulwark name.
const NAME_BYTES_MAX: usize = 64;
/// Prefix of the snapshots `CreateVolume` from a volume takes.
pub const CLONE_SNAPSHOT_PREFIX: &str = "csi-clone-";

/// Whether bulwark takes `name` as a volume or snapshot name.
pub fn valid(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= NAME_BYTES_MAX
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        && !name.starts_with(['-', '.'])
}

fn hash16(name: &str) -> String {
    blake3::hash(name.as_bytes()).to_hex()[..16].to_string()
}

/// The bulwark name for CSI name `name` (not empty).
pub fn bulwark_name(name: &str) -> String {
    if valid(name) {
        return name.to_string();
    }
    let clean: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '-'
            }
        })
        .collect();
    let clean = clean.trim_start_matches(['-', '.']);
    let head: String = clean.chars().take(47).collect();
    if head.is_empty() {
        format!("csi-{}", hash16(name))
    } else {
        format!("{head}-{}", hash16(name))
    }
}

/// The implicit snapshot of the source of a clone named `new` (a bulwark name).
pub fn clone_snapshot(new: &str) -> String {
    format!("{CLONE_SNAPSHOT_PREFIX}{}", hash16(new))
}

pub fn is_clone_snapshot(snapshot: &str) -> bool {
    snapshot.starts_with(CLONE_SNAPSHOT_PREFIX)
}

pub fn snapshot_id(volume: &str, snapshot: &str) -> String {
    format!("{volume}@{snapshot}")
}

/// `VOLUME@SNAPSHOT` as its two names; `None` for anything else.
pub fn parse_snapshot_id(id: &str) -> Option<(&str, &str)> {
    let (v, s) = id.split_once('@')?;
    (valid(v) && valid(s)).then_some((v, s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_fit_are_kept_others_are_derived_stably() {
        assert_eq!(bulwark_name("pvc-0b6a"), "pvc-0b6a");
        let long = "sanity-controller-create-maxlen-".repeat(4);
        let a = bulwark_name(&long);
        assert!(valid(&a) && a.len() == 64, "{a}");
        assert_eq!(a, bulwark_name(&long));
        assert_ne!(a, bulwark_name(&format!("{long}x")));
        let odd = bulwark_name("ns/Vol ume");
        assert!(valid(&odd) && odd.starts_with("ns-Vol-ume-"), "{odd}");
        assert!(valid(&bulwark_name("..//")));
        assert!(valid(&clone_snapshot("v")) && is_clone_snapshot(&clone_snapshot("v")));
    }

    #[test]
    fn snapshot_ids() {
        assert_eq!(parse_snapshot_id(&snapshot_id("v", "s")), Some(("v", "s")));
        assert_eq!(parse_snapshot_id("no-at"), None);
        assert_eq!(parse_snapshot_id("v@"), None);
        assert_eq!(parse_snapshot_id("v@s@t"), None);
    }
}
