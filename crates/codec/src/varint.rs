//! LEB128 varints for run lengths (at most 4096 here, so at most 2 bytes).

/// Appends `v`.
pub fn put(out: &mut Vec<u8>, mut v: usize) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Reads one varint of at most 3 bytes from `input[*pos..]`.
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
