//! Human sizes: "64K", "1G", "512", "1.5T", "1GiB" (binary units, as qemu-img and zfs read
//! them). "10GB" is refused rather than guessed: qemu-img reads its G as 2^30 but the
//! SI reading is 10^9, 7% apart; a disk silently 74 MB smaller or larger than meant is
//! worse than a clear message.

use crate::{Error, Result};

/// Parse a size with an optional K/M/G/T/P/E suffix (powers of 1024; "B" and "iB" accepted).
pub fn parse_size(text: &str) -> Result<u64> {
    let t = text.trim();
    let bad = || {
        Error::Invalid(format!(
            "invalid size '{text}': expected a whole number of bytes with an optional K, M, G, T, P or E suffix"
        ))
    };
    let too_large = || {
        Error::Invalid(format!(
            "invalid size '{text}': too large (sizes stop below 16E, 2^64 bytes)"
        ))
    };
    let iec = t.strip_suffix("iB").or_else(|| t.strip_suffix("ib"));
    let t = match iec {
        Some(t) => t,
        None => {
            // "10GB": SI or binary? Refused, saying how to write either.
            let unit = t.len() > 1 && t.ends_with(['B', 'b']);
            let prefix = t[..t.len().saturating_sub(1)].chars().last();
            if let (true, Some(p)) = (unit, prefix.filter(|c| "kKmMgGtTpPeE".contains(*c))) {
                let num = &t[..t.len() - 2];
                let p = p.to_ascii_uppercase();
                return Err(Error::Invalid(format!(
                    "ambiguous size '{text}': bulwark's units are binary, as qemu-img's \
                     ({num}{p} = {num}{p}iB, powers of 1024); write {num}{p} or {num}{p}iB, \
                     or the number of bytes for SI units"
                )));
            }
            if t.len() > 1 {
                t.strip_suffix(['B', 'b']).unwrap_or(t)
            } else {
                t
            }
        }
    };
    let (num, shift) = match t.chars().last().ok_or_else(bad)? {
        'k' | 'K' => (&t[..t.len() - 1], 10),
        'm' | 'M' => (&t[..t.len() - 1], 20),
        'g' | 'G' => (&t[..t.len() - 1], 30),
        't' | 'T' => (&t[..t.len() - 1], 40),
        'p' | 'P' => (&t[..t.len() - 1], 50),
        'e' | 'E' => (&t[..t.len() - 1], 60),
        _ => (t, 0),
    };
    if let Ok(n) = num.parse::<u64>() {
        return n.checked_mul(1u64 << shift).ok_or_else(too_large);
    }
    let f: f64 = num.parse().map_err(|_| bad())?;
    if !(f.is_finite() && f >= 0.0) {
        return Err(bad());
    }
    let v = f * (1u64 << shift) as f64;
    if v >= u64::MAX as f64 {
        return Err(too_large());
    }
    if v.fract() != 0.0 {
        return Err(Error::Invalid(format!(
            "invalid size '{text}': not a whole number of bytes ({v} bytes)"
        )));
    }
    Ok(v as u64)
}

/// Format bytes the way zfs list does: 1.50G, 512K, 0.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 7] = ["", "K", "M", "G", "T", "P", "E"];
    let mut v = bytes as f64;
    let mut i = 0;
    while v >= 1024.0 && i < UNITS.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{bytes}")
    } else if v >= 100.0 || v.fract() == 0.0 {
        format!("{:.0}{}", v, UNITS[i])
    } else {
        format!("{:.2}{}", v, UNITS[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn sizes() {
        assert_eq!(parse_size("4K").unwrap(), 4096);
        assert_eq!(parse_size("64k").unwrap(), 65536);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_size("10kib").unwrap(), 10 << 10);
        assert_eq!(parse_size("512B").unwrap(), 512);
        // "10GB" was read as 10 GiB without a word: now refused, naming both readings.
        for amb in ["10GB", "1.5TB", "64kB", "2mb"] {
            let e = parse_size(amb).unwrap_err().to_string();
            assert!(
                e.contains("ambiguous size") && e.contains("iB"),
                "{amb}: {e}"
            );
        }
        assert_eq!(parse_size("1.5T").unwrap(), 3 << 39);
        assert_eq!(parse_size("512").unwrap(), 512);
        assert!(parse_size("12Q").is_err());
        assert!(parse_size("").is_err());
        assert!(parse_size("-1").is_err());
        // A fraction of a byte is not cut off to a number the user never typed.
        let e = parse_size("1.5").unwrap_err().to_string();
        assert!(
            e.contains("'1.5'") && e.contains("whole number of bytes"),
            "{e}"
        );
        assert_eq!(parse_size("0.5K").unwrap(), 512);
        assert_eq!(format_size(1536 << 20), "1.50G");
        assert_eq!(format_size(0), "0");
        assert_eq!(parse_size("1E").unwrap(), 1 << 60);
        assert_eq!(format_size(1 << 60), "1E");
        // Past u64: said to be too large, not malformed.
        for big in ["99999999T", "16E", "18446744073709551616", "1e30"] {
            let e = parse_size(big).unwrap_err().to_string();
            assert!(e.contains("too large"), "{big}: {e}");
        }
    }
}
