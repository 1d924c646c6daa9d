//! Volume capabilities: what bulwark serves (block, or a mounted ext4 or xfs file
//! system, to the one node that holds the pool) and what it refuses.

use crate::mount::FS_TYPES;
use crate::proto::volume_capability::access_mode::Mode;
use crate::proto::volume_capability::AccessType;
use crate::proto::VolumeCapability;

/// How a capability attaches the volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Access {
    Block,
    /// A file system of this type (`ext4` when the CO named none) with these mount flags.
    Mount {
        fs: String,
        flags: Vec<String>,
    },
}

/// The capability's access, or why bulwark cannot serve it.
pub fn check(cap: &VolumeCapability) -> Result<Access, String> {
    let mode = cap
        .access_mode
        .as_ref()
        .ok_or("a volume capability needs an access mode")?
        .mode;
    match Mode::try_from(mode) {
        Ok(
            Mode::SingleNodeWriter
            | Mode::SingleNodeReaderOnly
            | Mode::SingleNodeSingleWriter
            | Mode::SingleNodeMultiWriter,
        ) => {}
        Ok(m) => {
            return Err(format!(
                "access mode {} is not supported: a bulwark volume is attached on the one \
                 node that holds its pool (single-node modes only)",
                m.as_str_name()
            ))
        }
        Err(_) => return Err(format!("unknown access mode {mode}")),
    }
    match cap.access_type.as_ref() {
        Some(AccessType::Block(_)) => Ok(Access::Block),
        Some(AccessType::Mount(m)) => {
            let fs = if m.fs_type.is_empty() {
                FS_TYPES[0].to_string()
            } else {
                m.fs_type.clone()
            };
            if !FS_TYPES.contains(&fs.as_str()) {
                return Err(format!(
                    "file system type '{fs}' is not supported (use {})",
                    FS_TYPES.join(" or ")
                ));
            }
            Ok(Access::Mount {
                fs,
                flags: m.mount_flags.clone(),
            })
        }
        None => Err("a volume capability needs an access type (block or mount)".into()),
    }
}

/// Whether the capability only reads.
pub fn read_only(cap: &VolumeCapability) -> bool {
    cap.access_mode.as_ref().map(|m| m.mode) == Some(Mode::SingleNodeReaderOnly as i32)
}
