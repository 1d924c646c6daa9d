//! `volume resize|get|set`: both sides. The CLI builds the request and prints the
//! answer; the daemon's half (`handle`) calls the engine (`Pool::volume_resize`,
//! `volume_props`, `volume_set`). What only the daemon knows (NBD connections
//! attached) it adds in `daemon`.

use std::path::Path;

use bulwark_engine::pool::props::{Resized, VolumeProps};
use bulwark_engine::size::format_size;
use bulwark_engine::Pool;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::cli::{VolumeGetArgs, VolumeResizeArgs, VolumeSetArgs};
use crate::client::{print, print_json, Client};
use crate::control::{to_value, ControlError, KeyStatus, Request};
use crate::display::{self, Align, Table};
use crate::error::{Error, Result};

// ---- CLI ---------------------------------------------------------------

/// The daemon's answer to `volume_resize`.
#[derive(Deserialize)]
struct ResizeAnswer {
    #[serde(flatten)]
    resized: Resized,
    /// NBD connections to the volume, which keep the size of their handshake.
    #[serde(default)]
    attached: usize,
}

pub fn resize(dir: &Path, args: &VolumeResizeArgs) -> Result<()> {
    let answer: ResizeAnswer = Client::connect(dir)?.call_typed(&Request::VolumeResize {
        name: args.name.clone(),
        size_bytes: args.size,
        shrink: args.shrink,
    })?;
    let r = &answer.resized;
    let mut out = if r.old_bytes == r.new_bytes {
        format!(
            "volume {} is already {}\n",
            r.name,
            format_size(r.new_bytes)
        )
    } else {
        format!(
            "resized volume {} from {} to {}{}\n",
            r.name,
            format_size(r.old_bytes),
            format_size(r.new_bytes),
            if r.old_depth != r.new_depth {
                format!(" (block map depth {} -> {})", r.old_depth, r.new_depth)
            } else {
                String::new()
            }
        )
    };
    if r.new_bytes > r.old_bytes {
        if answer.attached > 0 {
            out.push_str(&format!(
                "{} NBD connection(s) attached keep the old size ({}) until they reconnect \
                 (NBD fixes the size per connection): detach and attach again, then grow the \
                 file system\n",
                answer.attached,
                format_size(r.old_bytes)
            ));
        } else {
            out.push_str("new NBD connections see the new size\n");
        }
    }
    print(&out)
}

/// One row of `volume get`: the value as people read it, the same as JSON, and where it
/// comes from (`-` for read-only properties, `default` or `local` for settable ones).
struct Row {
    property: &'static str,
    value: String,
    raw: Value,
    source: &'static str,
}

fn row(property: &'static str, value: String, raw: Value, source: &'static str) -> Row {
    Row {
        property,
        value,
        raw,
        source,
    }
}

/// `volume get`'s originkeys: what the clone's key opens of its origin (issue 41).
fn origin_keys_value(p: &VolumeProps) -> String {
    match (&p.origin, p.inherited_keys) {
        (Some(origin), n) if n > 0 => {
            let vol = origin.split('@').next().unwrap_or(origin);
            format!(
                "{n} of {vol}: its key reads {vol}'s data up to the clone, not only {origin} \
                 (--independent or 'key rotate {}' drops them)",
                p.name
            )
        }
        _ => "-".into(),
    }
}

fn on_off(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}

/// Every property of `p`, in the order `volume get NAME all` shows them.
fn rows(p: &VolumeProps) -> Vec<Row> {
    let key = match (p.encryption, p.locked, p.key_slots) {
        (false, _, _) => KeyStatus::None.as_str(),
        (true, true, 0) => "erased",
        (true, true, _) => KeyStatus::Unavailable.as_str(),
        (true, false, _) => KeyStatus::Available.as_str(),
    };
    let set = |default: bool| if default { "default" } else { "local" };
    vec![
        row("size", format_size(p.size_bytes), json!(p.size_bytes), "-"),
        row(
            "blocksize",
            format_size(p.block_size as u64),
            json!(p.block_size),
            "-",
        ),
        row(
            "compression",
            p.compression.clone(),
            json!(p.compression),
            set(p.compression == "lz4"),
        ),
        row(
            "encryption",
            if p.encryption { "aes-256-gcm" } else { "off" }.into(),
            json!(p.encryption),
            "-",
        ),
        row("keystatus", key.into(), json!(key), "-"),
        row("used", format_size(p.used_bytes), json!(p.used_bytes), "-"),
        row(
            "referenced",
            format_size(p.referenced_bytes),
            json!(p.referenced_bytes),
            "-",
        ),
        row(
            "origin",
            p.origin.clone().unwrap_or_else(|| "-".into()),
            json!(p.origin),
            "-",
        ),
        row(
            "originkeys",
            origin_keys_value(p),
            json!(p.inherited_keys),
            "-",
        ),
        row(
            "snapshots",
            if p.snapshots.is_empty() {
                "-".into()
            } else {
                p.snapshots.join(",")
            },
            json!(p.snapshots),
            "-",
        ),
        row(
            "created",
            if p.created == 0 {
                "-".into()
            } else {
                display::date(p.created)
            },
            json!(p.created),
            "-",
        ),
        row(
            "provisioning",
            if p.thick { "thick" } else { "thin" }.into(),
            json!(if p.thick { "thick" } else { "thin" }),
            "-",
        ),
        row(
            "reservation",
            if p.thick {
                format_size(p.size_bytes)
            } else {
                "none".into()
            },
            json!(if p.thick { p.size_bytes } else { 0 }),
            "-",
        ),
        row(
            "description",
            if p.description.is_empty() {
                "-".into()
            } else {
                p.description.clone()
            },
            json!(p.description),
            set(p.description.is_empty()),
        ),
        row(
            "readonly",
            on_off(p.readonly).into(),
            json!(on_off(p.readonly)),
            set(!p.readonly),
        ),
    ]
}

pub fn get(dir: &Path, args: &VolumeGetArgs) -> Result<()> {
    let props: VolumeProps = Client::connect(dir)?.call_typed(&Request::VolumeGet {
        name: args.name.clone(),
    })?;
    let all = rows(&props);
    let shown: Vec<&Row> = if args.property == "all" {
        all.iter().collect()
    } else {
        let wanted: Vec<&str> = args.property.split(',').collect();
        let mut out = Vec::new();
        for w in &wanted {
            match all.iter().find(|r| r.property == *w) {
                Some(r) => out.push(r),
                None => {
                    return Err(Error::usage(format!(
                        "unknown property '{w}' (properties: {}, or all)",
                        all.iter()
                            .map(|r| r.property)
                            .collect::<Vec<_>>()
                            .join(", ")
                    )))
                }
            }
        }
        out
    };
    if args.json {
        let list: Vec<Value> = shown
            .iter()
            .map(|r| json!({ "property": r.property, "value": r.raw, "source": r.source }))
            .collect();
        return print_json(&list);
    }
    use Align::*;
    let mut t = Table::new(&[
        ("NAME", Left),
        ("PROPERTY", Left),
        ("VALUE", Left),
        ("SOURCE", Left),
    ]);
    for r in shown {
        t.row(vec![
            props.name.clone(),
            r.property.to_string(),
            r.value.clone(),
            r.source.to_string(),
        ]);
    }
    print(&t.render(""))
}

pub fn set(dir: &Path, args: &VolumeSetArgs) -> Result<()> {
    let mut client = Client::connect(dir)?;
    let mut out = String::new();
    for (property, value) in &args.assignments {
        client.call(&Request::VolumeSet {
            name: args.name.clone(),
            property: property.clone(),
            value: value.clone(),
        })?;
        let note = match (property.as_str(), value.as_str()) {
            ("compression", _) => ": applies to new writes",
            ("readonly", "on") => {
                ": new connections are exported read-only, and writes from connections \
                 attached before are refused (EPERM)"
            }
            _ => "",
        };
        out.push_str(&format!("volume {}: {property}={value}{note}\n", args.name));
    }
    print(&out)
}

// ---- daemon ------------------------------------------------------------

/// The daemon's half: `VolumeResize` (without the attached count, which `daemon` adds),
/// `VolumeGet`, `VolumeSet`.
pub fn handle(pool: &Pool, request: Request) -> std::result::Result<Value, ControlError> {
    match request {
        Request::VolumeResize {
            name,
            size_bytes,
            shrink,
        } => to_value(&pool.volume_resize(&name, size_bytes, shrink)?),
        Request::VolumeGet { name } => to_value(&pool.volume_props(&name)?),
        Request::VolumeSet {
            name,
            property,
            value,
        } => {
            pool.volume_set(&name, &property, &value)?;
            Ok(Value::Null)
        }
        other => Err(ControlError::internal(format!(
            "internal error: {other:?} is not a volume property request"
        ))),
    }
}
