//! Element-wise maths and activations for the CPU kernels: an exponential that
//! vectorises and is exactly 0 below the normal range, tanh from it, erf and the Gaussian
//! factor of GELU, and [`Act`] with its value and derivative.

use crate::nn::cpu::blocks::Float;

/// Feed-forward activations the fused kernel implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    /// Exact GELU, `x * Phi(x)`.
    GeluErf,
    /// The tanh approximation of GELU.
    GeluTanh,
    /// `max(x, 0)`.
    Relu,
    /// SiLU (swish), `x * sigmoid(x)`: the gate of the SwiGLU feed-forward of Llama,
    /// Mistral and the Qwen models.
    Silu,
}

/// Below this SiLU and its slope are taken as exactly 0 (`|x e^x|` < 1e-36 there), so that
/// `sigmoid(x)` never lands below f32's normal range (see [`crate::denormal`]).
const SILU_FLOOR: f64 = -87.0;

/// `sigmoid(x)` of a SiLU input at or above [`SILU_FLOOR`].
#[inline(always)]
fn sigmoid<T: Float>(x: T) -> T {
    T::one() / (T::one() + exp(-x))
}

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const FRAC_1_SQRT_2: f64 = std::f64::consts::FRAC_1_SQRT_2;

/// Below this `e^x` is below f32's normal range (`ln f32::MIN_POSITIVE` = -87.3365; the
/// bound sits a hair above it, where the polynomial's 2 ulp could still land below).
pub const EXP_UNDERFLOW_F32: f32 = -87.33;
/// The same bound for f64 (`ln f64::MIN_POSITIVE` = -708.396).
const EXP_UNDERFLOW_F64: f64 = -708.39;

/// `e^x`, exactly 0 where the true value is below the normal range (never a subnormal:
/// see [`crate::denormal`]). f64 takes libm's; f32 a branch-free polynomial (range
/// reduction to `|r| <= ln 2 / 2`, degree-7 Taylor polynomial, the power of two set in the
/// exponent bits; within 2 ulp), which the compiler vectorises where a call to `expf`
/// would stop it. The reduction and the polynomial's steps are fused multiply-adds
/// (`mul_add`: one rounding each, the same bits in every copy of a kernel, see
/// `crate::nn::cpu::blocks::wide_fn`), half the instructions of a multiply and an add.
#[inline(always)]
pub fn exp<T: Float>(x: T) -> T {
    if std::mem::size_of::<T>() == 8 {
        return if x < T::of(EXP_UNDERFLOW_F64) {
            T::zero()
        } else {
            x.exp()
        };
    }
    let x = num_traits::ToPrimitive::to_f32(&x).unwrap_or(0.0);
    T::of(f64::from(exp_f32(x)))
}

#[inline(always)]
fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Round to nearest without a call: adding 1.5 * 2^23 pushes the fraction out, and
    // leaves the integer in the low bits of the sum.
    const ROUND: f32 = 12_582_912.0;
    // Comparisons and selects, no `clamp` (which checks its bounds) and no float to
    // integer cast (which saturates): both would stop the loop from vectorising.
    let underflow = x < EXP_UNDERFLOW_F32;
    #[allow(clippy::manual_clamp)]
    let x = if x < EXP_UNDERFLOW_F32 {
        EXP_UNDERFLOW_F32
    } else if x > 88.0 {
        88.0
    } else {
        x
    };
    let shifted = x.mul_add(LOG2E, ROUND);
    let n = shifted - ROUND;
    let r = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, x));
    let mut p: f32 = 1.0 / 5040.0;
    for c in [
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ] {
        p = p.mul_add(r, c);
    }
    // 2^n in the exponent bits: n is the low bits of `shifted` (two's complement).
    let n_bits = shifted.to_bits().wrapping_sub(ROUND.to_bits());
    let scale = f32::from_bits(n_bits.wrapping_add(127) << 23);
    // A select, not a branch: the loop stays vectorised.
    if underflow {
        0.0
    } else {
        p * scale
    }
}

/// `tanh(x)` for f32 from [`exp`]: `1 - 2 / (e^{2x} + 1)` (vectorises where libm's
/// `tanhf` does not; absolute error about 2e-7), f64 libm's.
#[inline(always)]
fn tanh<T: Float>(x: T) -> T {
    if std::mem::size_of::<T>() == 8 {
        return x.tanh();
    }
    let two = T::of(2.0);
    T::one() - two / (exp(two * x) + T::one())
}

/// `(erf(x / sqrt 2), exp(-x^2 / 2))`, the two pieces of GELU and its derivative. f64
/// takes libm's erf (exact to the last bit); f32 a rational approximation (Abramowitz and
/// Stegun 7.1.26, absolute error below 1.5e-7, about the f32 rounding of the result,
/// its steps fused multiply-adds as [`exp`]'s) whose one `exp` is the Gaussian factor
/// itself, where libm's erf costs several times that and dominated the GELU kernels.
#[inline(always)]
pub(crate) fn erf_and_gaussian<T: Float>(x: T) -> (T, T) {
    // Past |x| = 12.9 the Gaussian factor is exactly 0 (its true value, below 2.4e-37,
    // changes neither erf, which is +-1 in f32 from |x| = 5.5 on, nor GELU's derivative
    // beyond 1e-35), so that its products with the polynomial and with x never land
    // below the normal range (subnormal; see `crate::denormal`).
    let half_square = T::of(0.5) * x * x;
    let gaussian = if half_square > T::of(84.0) && std::mem::size_of::<T>() == 4 {
        T::zero()
    } else {
        exp(-half_square)
    };
    if std::mem::size_of::<T>() == 8 {
        let z = num_traits::ToPrimitive::to_f64(&x).unwrap_or(0.0) * FRAC_1_SQRT_2;
        return (T::of(libm::erf(z)), gaussian);
    }
    let a = x.abs() * T::of(FRAC_1_SQRT_2);
    let t = T::one() / T::of(0.327_591_1).mul_add(a, T::one());
    let mut q = T::of(1.061_405_429);
    for c in [-1.453_152_027, 1.421_413_741, -0.284_496_736, 0.254_829_592] {
        q = q.mul_add(t, T::of(c));
    }
    let poly = q * t;
    // exp(-a^2) with a = |x| / sqrt 2 is the Gaussian factor.
    let y = (-poly).mul_add(gaussian, T::one());
    (if x < T::zero() { -y } else { y }, gaussian)
}

impl Act {
    #[inline(always)]
    pub(crate) fn value<T: Float>(self, x: T) -> T {
        let half = T::of(0.5);
        match self {
            Act::GeluErf => half * x * (T::one() + erf_and_gaussian(x).0),
            Act::GeluTanh => {
                let inner = T::of(SQRT_2_OVER_PI) * (x + T::of(0.044715) * x * x * x);
                half * x * (T::one() + tanh(inner))
            }
            Act::Relu => num_traits::Float::max(x, T::zero()),
            Act::Silu => {
                // A select, not a branch: the element loop stays vectorised.
                let v = x * sigmoid(x);
                if x < T::of(SILU_FLOOR) {
                    T::zero()
                } else {
                    v
                }
            }
        }
    }

    /// `(act(x), act'(x))` with one evaluation of what they share (GELU's erf and
    /// Gaussian factor): the same bits as [`Self::value`] and [`Self::derivative`].
    #[inline(always)]
    pub(crate) fn value_and_derivative<T: Float>(self, x: T) -> (T, T) {
        let half = T::of(0.5);
        match self {
            Act::GeluErf => {
                let (erf, gaussian) = erf_and_gaussian(x);
                let value = half * x * (T::one() + erf);
                let cdf = half * (T::one() + erf);
                (value, cdf + x * gaussian * T::of(0.398_942_280_401_432_7))
            }
            Act::Silu => {
                // Selects, not a branch: the element loop stays vectorised.
                let s = sigmoid(x);
                let (v, d) = (x * s, s + x * s * (T::one() - s));
                let low = x < T::of(SILU_FLOOR);
                (
                    if low { T::zero() } else { v },
                    if low { T::zero() } else { d },
                )
            }
            other => (other.value(x), other.derivative(x)),
        }
    }

    #[inline(always)]
    pub(crate) fn derivative<T: Float>(self, x: T) -> T {
        let half = T::of(0.5);
        match self {
            Act::GeluErf => {
                let (erf, gaussian) = erf_and_gaussian(x);
                let cdf = half * (T::one() + erf);
                cdf + x * gaussian * T::of(0.398_942_280_401_432_7)
            }
            Act::GeluTanh => {
                let c = T::of(SQRT_2_OVER_PI);
                let a = T::of(0.044715);
                let t = tanh(c * (x + a * x * x * x));
                half * (T::one() + t)
                    + half * x * (T::one() - t * t) * c * (T::one() + T::of(3.0) * a * x * x)
            }
            Act::Relu => {
                if x > T::zero() {
                    T::one()
                } else {
                    T::zero()
                }
            }
            Act::Silu => self.value_and_derivative(x).1,
        }
    }
}
