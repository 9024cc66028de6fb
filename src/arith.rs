//! Integer arithmetic that neither overflows nor pays for 128 bits when 64 suffice.

/// `a × b / c` rounded down, saturating at `u64::MAX`; `c` is never zero (limits' rates and
/// periods are validated). In 64 bits when the product fits (responses' fields compute a
/// few of these per request, and a 128-bit division is a slow library call).
#[inline]
pub(crate) fn mul_div(a: u64, b: u64, c: u64) -> u64 {
    match a.checked_mul(b) {
        Some(product) => product / c,
        None => u64::try_from(u128::from(a) * u128::from(b) / u128::from(c)).unwrap_or(u64::MAX),
    }
}

/// `a × b / c` rounded up, saturating at `u64::MAX`; `c` is never zero.
#[inline]
pub(crate) fn mul_div_ceil(a: u64, b: u64, c: u64) -> u64 {
    match a.checked_mul(b) {
        Some(product) => product.div_ceil(c),
        None => {
            let exact = (u128::from(a) * u128::from(b)).div_ceil(u128::from(c));
            u64::try_from(exact).unwrap_or(u64::MAX)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mul_div_agrees_with_128_bit_arithmetic_on_both_sides_of_overflow() {
        let values = [
            0,
            1,
            3,
            999,
            1_000_000,
            u64::from(u32::MAX),
            1 << 40,
            u64::MAX / 7,
            u64::MAX,
        ];
        for a in values {
            for b in values {
                for c in values.iter().copied().filter(|&c| c > 0) {
                    let exact = u128::from(a) * u128::from(b);
                    let floor = u64::try_from(exact / u128::from(c)).unwrap_or(u64::MAX);
                    let ceil = u64::try_from(exact.div_ceil(u128::from(c))).unwrap_or(u64::MAX);
                    assert_eq!(mul_div(a, b, c), floor, "{a} * {b} / {c}");
                    assert_eq!(mul_div_ceil(a, b, c), ceil, "{a} * {b} / {c}, up");
                }
            }
        }
    }
}
