//! Sizes and rates as users write them: `1G`, `512M`, `1Gbit`, `500MB`.

/// Parses a byte size: a number with an optional K, M, G or T suffix
/// (binary multiples; a trailing `B` or `iB` is allowed).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let lower = t.to_ascii_lowercase();
    let body = lower.strip_suffix("ib").or_else(|| lower.strip_suffix('b')).unwrap_or(&lower);
    let (digits, shift) = match body.chars().last() {
        Some('k') => (&body[..body.len() - 1], 10),
        Some('m') => (&body[..body.len() - 1], 20),
        Some('g') => (&body[..body.len() - 1], 30),
        Some('t') => (&body[..body.len() - 1], 40),
        _ => (body, 0),
    };
    let n: u64 = digits.parse().map_err(|_| format!("'{text}' is not a size (try 512M or 1G)"))?;
    n.checked_mul(1 << shift).ok_or_else(|| format!("'{text}' is too large"))
}

/// Parses a rate into bytes per second: `1Gbit`, `100Mbit` (decimal bits),
/// or `500MB`, `1GB` (decimal bytes) per second. A plain number is bytes/s.
pub fn parse_rate(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let lower = t.to_ascii_lowercase();
    let lower = lower.strip_suffix("/s").unwrap_or(&lower);
    let err = || format!("'{text}' is not a rate (try 1Gbit, 100Mbit or 500MB)");
    let (number, unit_bytes) = if let Some(n) = lower.strip_suffix("bit") {
        (n, 1.0 / 8.0)
    } else if let Some(n) = lower.strip_suffix('b') {
        (n, 1.0)
    } else {
        (lower, 1.0)
    };
    let (digits, scale) = match number.chars().last() {
        Some('k') => (&number[..number.len() - 1], 1e3),
        Some('m') => (&number[..number.len() - 1], 1e6),
        Some('g') => (&number[..number.len() - 1], 1e9),
        Some('t') => (&number[..number.len() - 1], 1e12),
        _ => (number, 1.0),
    };
    let value: f64 = digits.parse().map_err(|_| err())?;
    if !value.is_finite() || value <= 0.0 {
        return Err(err());
    }
    let bytes = value * scale * unit_bytes;
    if !(1.0..=1e15).contains(&bytes) {
        return Err(err());
    }
    Ok(bytes as u64)
}

/// Parses a duration: `10ms`, `1.5s`, or a plain number of milliseconds.
pub fn parse_duration(text: &str) -> Result<std::time::Duration, String> {
    let t = text.trim().to_ascii_lowercase();
    let err = || format!("'{text}' is not a duration (try 10ms or 2s)");
    let (number, scale) = if let Some(n) = t.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1.0)
    } else {
        (t.as_str(), 1e-3)
    };
    let value: f64 = number.trim().parse().map_err(|_| err())?;
    if !value.is_finite() || value < 0.0 || value * scale > 1e6 {
        return Err(err());
    }
    Ok(std::time::Duration::from_secs_f64(value * scale))
}

/// Human-readable bytes: `1.5 GiB`.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("512M").unwrap(), 512 << 20);
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("lots").is_err());
        assert!(parse_size("99999999999T").is_err());
    }

    #[test]
    fn rates() {
        assert_eq!(parse_rate("1Gbit").unwrap(), 125_000_000);
        assert_eq!(parse_rate("100Mbit").unwrap(), 12_500_000);
        assert_eq!(parse_rate("500MB").unwrap(), 500_000_000);
        assert_eq!(parse_rate("2.5Gbit").unwrap(), 312_500_000);
        assert!(parse_rate("fast").is_err());
        assert!(parse_rate("0Gbit").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("10ms").unwrap().as_millis(), 10);
        assert_eq!(parse_duration("1.5s").unwrap().as_millis(), 1500);
        assert_eq!(parse_duration("300").unwrap().as_millis(), 300);
        assert!(parse_duration("soon").is_err() && parse_duration("-1s").is_err());
    }

    #[test]
    fn formats() {
        assert_eq!(format_bytes(512), "512 B");
        assert_eq!(format_bytes(3 << 29), "1.5 GiB");
    }
}
