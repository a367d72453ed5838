/* Just enough floating-point math for the Zipf generator (no libm here). */
#include "guest.h"
#include "workload.h"

#define LN2 0.69314718055994530942

/* ln(x) for x > 0: split off the binary exponent, then 2*atanh((m-1)/(m+1)). */
double guest_log(double x)
{
    union {
        double d;
        u64 u;
    } v = {.d = x};
    i64 e = (i64)((v.u >> 52) & 0x7FF) - 1023;
    v.u = (v.u & 0x000FFFFFFFFFFFFFUL) | 0x3FF0000000000000UL; /* m in [1,2) */
    double m = v.d;
    if (m > 1.41421356237309504880) {
        m *= 0.5;
        e++;
    }
    double s = (m - 1) / (m + 1), s2 = s * s, term = s, sum = 0;
    for (int k = 1; k < 40; k += 2) {
        sum += term / k;
        term *= s2;
    }
    return 2 * sum + (double)e * LN2;
}

/* e^x: x = k*ln2 + r with |r| <= ln2/2, Taylor series for e^r. */
double guest_exp(double x)
{
    if (x < -700)
        return 0;
    if (x > 700)
        x = 700;
    i64 k = (i64)(x / LN2 + (x >= 0 ? 0.5 : -0.5));
    double r = x - (double)k * LN2, term = 1, sum = 1;
    for (int i = 1; i < 20; i++) {
        term *= r / i;
        sum += term;
    }
    union {
        double d;
        u64 u;
    } scale = {.u = (u64)(k + 1023) << 52};
    return sum * scale.d;
}

double guest_pow(double x, double y) { return x <= 0 ? 0 : guest_exp(y * guest_log(x)); }
