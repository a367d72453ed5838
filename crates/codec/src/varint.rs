//! LEB128 varints for run lengths (at most 4096 here, so at most 2 bytes).

/// Appends `v`.
#[inline]
pub fn put(out: &mut Vec<u8>, mut v: usize) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Bytes `put` writes for `v`.
#[inline]
pub fn len(mut v: usize) -> usize {
    let mut n = 1;
    while v >= 0x80 {
        v >>= 7;
        n += 1;
    }
    n
}

/// Reads one varint of at most 3 bytes (values below 2^21) from
/// `input[*pos..]`; None when it is cut short or longer.
#[inline]
pub fn get(input: &[u8], pos: &mut usize) -> Option<usize> {
    let mut v = 0usize;
    for shift in [0, 7, 14] {
        let b = *input.get(*pos)?;
        *pos += 1;
        v |= ((b & 0x7F) as usize) << shift;
        if b & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_sizes() {
        for v in [0, 1, 127, 128, 4096, 16383, 16384, (1 << 21) - 1] {
            let mut out = Vec::new();
            put(&mut out, v);
            assert_eq!(out.len(), len(v), "{v}");
            let mut pos = 0;
            assert_eq!(get(&out, &mut pos), Some(v));
            assert_eq!(pos, out.len());
        }
        assert_eq!(get(&[0x80, 0x80, 0x80, 0x01], &mut 0), None, "four bytes");
        assert_eq!(get(&[0x80], &mut 0), None, "cut short");
    }
}
