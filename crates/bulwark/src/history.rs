//! `bulwark history`: the audit log (`DIR/audit.log`, written by
//! `access::Audit::record`) for people, as `zpool history` prints a pool's.
//!
//! It reads the file itself, so it works with the daemon stopped. One line
//! per record: TIME EVENT CLIENT VOLUME RESULT DETAIL (the detail shortened
//! to `key=value` pairs); `--json` prints the matching records' lines as
//! they are in the file. Filters: `--volume`, `--client`, `--event`,
//! `--since`/`--until` (RFC 3339, a date, or an age such as `90m`, `1h`, `2d`).
//! A last line without its newline (a write cut short by a crash) or a line
//! that is not a record is skipped with a warning on stderr, never fatal.

use std::io::ErrorKind;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::Value;

use crate::access::AUDIT_FILE;
use crate::cli::HistoryArgs;
use crate::client;
use crate::display::{Align, Table};
use crate::error::{Error, Result};

/// Detail cells longer than this are cut, with "..." (`--json` has it whole).
const DETAIL_CHARS: usize = 100;

pub fn history(dir: &Path, args: &HistoryArgs) -> Result<()> {
    let since = args.since.as_deref().map(parse_time).transpose()?;
    let until = args.until.as_deref().map(parse_time).transpose()?;
    let path = dir.join(AUDIT_FILE);
    let text = match std::fs::read(&path) {
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(e) if e.kind() == ErrorKind::NotFound && dir.is_dir() => {
            eprintln!("no history yet: {} does not exist", path.display());
            return Ok(());
        }
        Err(e) => return Err(Error::msg(format!("cannot read {}: {e}", path.display()))),
    };
    let (records, warnings) = parse_log(&text);
    for w in &warnings {
        eprintln!("warning: {}: {w}", path.display());
    }
    let filter = Filter {
        volume: args.volume.as_deref(),
        client: args.client.as_deref(),
        event: args.event.as_deref(),
        since,
        until,
    };
    let picked: Vec<&Entry> = records.iter().filter(|r| filter.keeps(r)).collect();
    let mut out = String::new();
    if args.json {
        for r in picked {
            out.push_str(r.line);
            out.push('\n');
        }
    } else {
        out = history_table(&picked);
    }
    client::print(&out)
}

/// One record: its line as written and the parsed object.
struct Entry<'a> {
    line: &'a str,
    record: Value,
    /// Milliseconds since the epoch, when its time parses.
    time_ms: Option<i64>,
}

impl Entry<'_> {
    fn field(&self, name: &str) -> &str {
        self.record.get(name).and_then(Value::as_str).unwrap_or("-")
    }
}

/// The records of the log, and what was skipped and why.
fn parse_log(text: &str) -> (Vec<Entry<'_>>, Vec<String>) {
    let mut records = Vec::new();
    let mut warnings = Vec::new();
    let torn = !text.is_empty() && !text.ends_with('\n');
    let lines: Vec<&str> = text.split_terminator('\n').collect();
    for (i, line) in lines.iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let last = i + 1 == lines.len();
        match serde_json::from_str::<Value>(line) {
            Ok(record) if record.is_object() && !(last && torn) => {
                let time_ms = record
                    .get("time")
                    .and_then(Value::as_str)
                    .and_then(|t| parse_rfc3339(t).ok());
                records.push(Entry {
                    line,
                    record,
                    time_ms,
                });
            }
            _ if last && torn => warnings.push(format!(
                "the last line is incomplete ({} bytes, no newline: a write cut short?); skipped",
                line.len()
            )),
            _ => warnings.push(format!("line {} is not an audit record; skipped", i + 1)),
        }
    }
    (records, warnings)
}

struct Filter<'a> {
    volume: Option<&'a str>,
    client: Option<&'a str>,
    event: Option<&'a str>,
    since: Option<i64>,
    until: Option<i64>,
}

impl Filter<'_> {
    fn keeps(&self, r: &Entry) -> bool {
        let eq = |want: Option<&str>, field| want.is_none_or(|w| r.field(field) == w);
        let in_time = match (self.since, self.until) {
            (None, None) => true,
            _ => r.time_ms.is_some_and(|t| {
                self.since.is_none_or(|s| t >= s) && self.until.is_none_or(|u| t <= u)
            }),
        };
        eq(self.volume, "volume") && eq(self.client, "client") && eq(self.event, "event") && in_time
    }
}

fn history_table(records: &[&Entry]) -> String {
    if records.is_empty() {
        return "no records\n".into();
    }
    use Align::Left;
    let mut t = Table::new(&[
        ("TIME", Left),
        ("EVENT", Left),
        ("CLIENT", Left),
        ("VOLUME", Left),
        ("RESULT", Left),
        ("DETAIL", Left),
    ]);
    for r in records {
        t.row(vec![
            cell(r.field("time"), FIELD_CHARS),
            cell(r.field("event"), FIELD_CHARS),
            cell(r.field("client"), FIELD_CHARS),
            cell(r.field("volume"), FIELD_CHARS),
            cell(r.field("result"), FIELD_CHARS),
            short_detail(r.record.get("detail").unwrap_or(&Value::Null)),
        ]);
    }
    t.render("")
}

/// Widest field of a row but the detail, in characters: a volume or client name (at
/// most 64 when made by a command; an NBD client may ask for any export name, and a
/// refused one is logged as asked).
const FIELD_CHARS: usize = 64;

/// A field as one line of plain text for a terminal: control characters shown escaped
/// (`\n`, `\u{1b}`: a name an NBD client sent must not start a forged line or move the
/// cursor), cut to `max` characters with `...`.
fn cell(s: &str, max: usize) -> String {
    let mut out = String::new();
    for c in s.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    if out.chars().count() > max {
        let cut: String = out.chars().take(max - 3).collect();
        format!("{cut}...")
    } else {
        out
    }
}

/// `key=value` pairs (strings unquoted, nested values as compact JSON); an
/// error answer's message first. Cut to `DETAIL_CHARS`.
fn short_detail(detail: &Value) -> String {
    let text = match detail {
        Value::Null => String::new(),
        Value::String(s) => s.clone(),
        Value::Object(map) => {
            let mut parts: Vec<String> = Vec::new();
            if let Some(Value::String(e)) = map.get("error") {
                parts.push(format!("error: {e};"));
            }
            for (k, v) in map {
                if k == "error" && v.is_string() {
                    continue;
                }
                match v {
                    Value::String(s) => parts.push(format!("{k}={s}")),
                    Value::Null => {}
                    v => parts.push(format!("{k}={v}")),
                }
            }
            parts.join(" ")
        }
        v => v.to_string(),
    };
    cell(&text.replace(['\n', '\t'], " "), DETAIL_CHARS)
}

/// `--since`/`--until`: RFC 3339 (`2024-05-01T12:00:00Z`, `...+02:00`, a space
/// for the T), a date (`2024-05-01`, midnight UTC), or an age before now:
/// a number and s, m, h, d or w (`90m`, `1h`, `2d`). Milliseconds since the epoch.
fn parse_time(s: &str) -> Result<i64> {
    let s = s.trim();
    if let Some(age) = parse_age(s) {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        return Ok(now.as_millis() as i64 - age);
    }
    parse_rfc3339(s).map_err(|why| {
        Error::usage(format!(
            "invalid time '{s}': {why} (give RFC 3339 like 2024-05-01T12:00:00Z, a date like \
             2024-05-01, or an age like 30m, 1h, 2d)"
        ))
    })
}

/// `90m` → milliseconds, or `None` when `s` is not an age.
fn parse_age(s: &str) -> Option<i64> {
    let unit = s.chars().last()?;
    let secs: i64 = match unit {
        's' => 1,
        'm' => 60,
        'h' => 3600,
        'd' => 86_400,
        'w' => 7 * 86_400,
        _ => return None,
    };
    let n: i64 = s[..s.len() - 1].parse().ok()?;
    n.checked_mul(secs * 1000)
}

/// RFC 3339 (or a bare date) → milliseconds since the epoch.
fn parse_rfc3339(s: &str) -> std::result::Result<i64, String> {
    let num = |part: &str, what: &str| -> std::result::Result<i64, String> {
        if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!("bad {what} '{part}'"));
        }
        part.parse::<i64>()
            .map_err(|_| format!("bad {what} '{part}'"))
    };
    let (date, rest) = match s.find(['T', 't', ' ']) {
        Some(i) => (&s[..i], Some(&s[i + 1..])),
        None => (s, None),
    };
    let d: Vec<&str> = date.split('-').collect();
    let [y, mo, da] = d[..] else {
        return Err("the date is not YYYY-MM-DD".into());
    };
    let (y, mo, da) = (num(y, "year")?, num(mo, "month")?, num(da, "day")?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&da) {
        return Err("month or day out of range".into());
    }
    let mut ms = days_from_civil(y, mo, da) * 86_400_000;
    let Some(rest) = rest else {
        return Ok(ms);
    };
    let (clock, offset_min) = if let Some(c) = rest.strip_suffix(['Z', 'z']) {
        (c, 0)
    } else if let Some(i) = rest.rfind(['+', '-']) {
        let (h, m) = rest[i + 1..]
            .split_once(':')
            .ok_or("the offset is not +HH:MM")?;
        let sign = if rest.as_bytes()[i] == b'-' { -1 } else { 1 };
        (
            &rest[..i],
            sign * (num(h, "offset hour")? * 60 + num(m, "offset minute")?),
        )
    } else {
        return Err("no time zone (end with Z or +HH:MM)".into());
    };
    let (hms, frac) = clock.split_once('.').unwrap_or((clock, ""));
    let t: Vec<&str> = hms.split(':').collect();
    let [h, mi, se] = t[..] else {
        return Err("the time is not HH:MM:SS".into());
    };
    let (h, mi, se) = (num(h, "hour")?, num(mi, "minute")?, num(se, "second")?);
    if h > 23 || mi > 59 || se > 60 {
        return Err("hour, minute or second out of range".into());
    }
    ms += (h * 3600 + mi * 60 + se - offset_min * 60) * 1000;
    if !frac.is_empty() {
        let digits = num(frac, "fraction")?;
        let scale = 10i64.pow(frac.len().min(18) as u32);
        ms += digits * 1000 / scale;
    }
    Ok(ms)
}

/// (year, month, day) → days since 1970-01-01, proleptic Gregorian (Howard
/// Hinnant's algorithm; `access::civil_from_days` is its inverse).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_parse_as_the_log_writes_them_and_as_people_type_them() {
        let t = SystemTime::UNIX_EPOCH + std::time::Duration::from_millis(1_714_566_896_789);
        let written = crate::access::rfc3339(t);
        assert_eq!(written, "2024-05-01T12:34:56.789Z");
        assert_eq!(parse_rfc3339(&written), Ok(1_714_566_896_789));
        assert_eq!(
            parse_rfc3339("2024-05-01T14:34:56.789+02:00"),
            Ok(1_714_566_896_789)
        );
        assert_eq!(parse_rfc3339("2024-05-01 12:34:56Z"), Ok(1_714_566_896_000));
        assert_eq!(parse_rfc3339("2024-05-01"), Ok(1_714_521_600_000));
        assert_eq!(parse_rfc3339("1970-01-01T00:00:00Z"), Ok(0));
        assert!(parse_rfc3339("2024-05-01T12:34:56").is_err());
        assert!(parse_rfc3339("yesterday").is_err());
        assert!(parse_time("1h").unwrap() < parse_time("30m").unwrap());
        assert!(parse_time("3x").is_err());
    }

    #[test]
    fn torn_last_line_is_reported_and_skipped() {
        let log = concat!(
            r#"{"time":"2024-05-01T00:00:00.000Z","event":"volume_create","client":"owner","peer":"control socket","volume":"v","result":"ok","detail":{"size_bytes":16}}"#,
            "\nnot json\n",
            r#"{"time":"2024-05-01T00:00:01.000Z","event":"volume_dest"#,
        );
        let (records, warnings) = parse_log(log);
        assert_eq!(records.len(), 1);
        assert_eq!(records[0].field("volume"), "v");
        assert_eq!(warnings.len(), 2, "{warnings:?}");
        assert!(warnings[0].contains("line 2"), "{warnings:?}");
        assert!(
            warnings[1].contains("last line is incomplete"),
            "{warnings:?}"
        );
        let text = history_table(&records.iter().collect::<Vec<_>>());
        assert_eq!(
            text,
            "TIME                      EVENT          CLIENT  VOLUME  RESULT  DETAIL\n\
             2024-05-01T00:00:00.000Z  volume_create  owner   v       ok      size_bytes=16\n"
        );
    }

    /// An export name an NBD client sent is logged as sent (the JSON escapes it); the
    /// table shows it escaped and cut, so it cannot add a forged line or colour the
    /// terminal.
    #[test]
    fn names_from_clients_cannot_forge_lines_or_move_the_cursor() {
        let forged = "zz\n2099-01-01T00:00:00.000Z  volume_destroy  owner  vm1  ok\u{1b}[31mRED";
        let rec = serde_json::json!({"time": "2024-05-01T00:00:00.000Z", "event": "attach",
            "client": "owner", "volume": forged, "result": "denied",
            "detail": {"error": "no such export\u{1b}[0m"}});
        let long = serde_json::json!({"time": "2024-05-01T00:00:01.000Z", "event": "attach",
            "client": "owner", "volume": "n".repeat(300), "result": "denied"});
        let log = format!("{rec}\n{long}\n");
        let (records, warnings) = parse_log(&log);
        assert!(warnings.is_empty(), "{warnings:?}");
        let text = history_table(&records.iter().collect::<Vec<_>>());
        assert_eq!(text.lines().count(), 3, "{text}");
        assert!(!text.contains('\u{1b}'), "{text}");
        assert!(text.contains(r"zz\n2099-01-01"), "{text}");
        assert!(text.contains(r"export\u{1b}[0m"), "{text}");
        let widest = text.lines().map(|l| l.chars().count()).max().unwrap();
        assert!(widest < 250, "a 300-character name was not cut: {widest}");
        assert!(
            text.contains(&format!("{}...", "n".repeat(FIELD_CHARS - 3))),
            "{text}"
        );
    }

    #[test]
    fn an_error_answer_shows_its_message_first() {
        let d = serde_json::json!({"error": "no such volume", "request": {"name": "x"}});
        assert_eq!(
            short_detail(&d),
            r#"error: no such volume; request={"name":"x"}"#
        );
        let long = Value::String("x".repeat(300));
        assert_eq!(short_detail(&long).chars().count(), DETAIL_CHARS);
    }
}
