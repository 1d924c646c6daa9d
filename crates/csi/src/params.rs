//! StorageClass parameters of `CreateVolume`, checked at the edge.
//!
//! `encryption` (on/off, true/false; default on, as for `volume create`),
//! `compression` (lz4/off; default lz4), `blockSize` (a power of two, 4K to 128K,
//! as bytes or with K; default 4K), `thick` (true/false; default false). Keys under
//! `csi.storage.k8s.io/` are the sidecars' and are ignored; any other key is refused,
//! so a misspelt `encrypted: "true"` does not silently make a plain volume.

use std::collections::HashMap;

/// What the parameters ask for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Params {
    pub encryption: bool,
    pub compression: String,
    pub block_size: u32,
    pub thick: bool,
}

impl Default for Params {
    fn default() -> Params {
        Params {
            encryption: true,
            compression: "lz4".into(),
            block_size: 4096,
            thick: false,
        }
    }
}

fn flag(key: &str, v: &str) -> Result<bool, String> {
    match v.to_ascii_lowercase().as_str() {
        "on" | "true" | "yes" | "1" => Ok(true),
        "off" | "false" | "no" | "0" => Ok(false),
        _ => Err(format!(
            "parameter {key}: '{v}' is not on/off or true/false"
        )),
    }
}

impl Params {
    pub fn parse(map: &HashMap<String, String>) -> Result<Params, String> {
        let mut p = Params::default();
        for (k, v) in map {
            match k.as_str() {
                "encryption" => p.encryption = flag(k, v)?,
                "thick" => p.thick = flag(k, v)?,
                "compression" => match v.to_ascii_lowercase().as_str() {
                    "lz4" | "on" => p.compression = "lz4".into(),
                    "off" | "none" => p.compression = "off".into(),
                    _ => return Err(format!("parameter compression: '{v}' is not lz4 or off")),
                },
                "blockSize" => p.block_size = block_size(v)?,
                _ if k.starts_with("csi.storage.k8s.io/") => {}
                _ => {
                    return Err(format!(
                        "unknown parameter '{k}' (bulwark takes encryption, compression, \
                         blockSize and thick)"
                    ))
                }
            }
        }
        Ok(p)
    }
}

fn block_size(v: &str) -> Result<u32, String> {
    let t = v.trim();
    let (num, mul) = match t.strip_suffix(['K', 'k']) {
        Some(n) => (n, 1024),
        None => (t, 1),
    };
    let n: u32 = num
        .parse()
        .ok()
        .and_then(|n: u32| n.checked_mul(mul))
        .ok_or_else(|| format!("parameter blockSize: '{v}' is not a size"))?;
    if !(4096..=131072).contains(&n) || !n.is_power_of_two() {
        return Err(format!(
            "parameter blockSize: {v} is not a power of two from 4K to 128K"
        ));
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(pairs: &[(&str, &str)]) -> Result<Params, String> {
        Params::parse(
            &pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    #[test]
    fn defaults_and_values() {
        assert_eq!(parse(&[]).unwrap(), Params::default());
        let p = parse(&[
            ("encryption", "off"),
            ("compression", "off"),
            ("blockSize", "64K"),
            ("thick", "true"),
            ("csi.storage.k8s.io/pv/name", "pv-1"),
        ])
        .unwrap();
        assert_eq!(
            p,
            Params {
                encryption: false,
                compression: "off".into(),
                block_size: 65536,
                thick: true
            }
        );
        assert_eq!(parse(&[("blockSize", "8192")]).unwrap().block_size, 8192);
    }

    #[test]
    fn mistakes_are_refused() {
        assert!(parse(&[("encrypted", "true")])
            .unwrap_err()
            .contains("unknown"));
        assert!(parse(&[("encryption", "maybe")]).is_err());
        assert!(parse(&[("blockSize", "3K")]).is_err());
        assert!(parse(&[("blockSize", "256K")]).is_err());
        assert!(parse(&[("compression", "zstd")]).is_err());
    }
}
