//! Physical units. Power is carried as [`Watts`] everywhere inside powerflex; milliwatts
//! exist only at the NVML edge (the agent converts there, in one place).

use std::fmt;
use std::iter::Sum;
use std::ops::{Add, AddAssign, Div, Mul, Sub, SubAssign};

use serde::{Deserialize, Serialize};

/// Electrical power in watts. A per-GPU cap, a job's summed draw or a facility budget.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Watts(pub f64);

impl Watts {
    pub const ZERO: Watts = Watts(0.0);

    pub fn get(self) -> f64 {
        self.0
    }

    pub fn min(self, other: Watts) -> Watts {
        Watts(self.0.min(other.0))
    }

    pub fn max(self, other: Watts) -> Watts {
        Watts(self.0.max(other.0))
    }

    /// Parses `850kW`, `0.85 MW` or `700W`. A bare number is refused: `budget set 850`
    /// meaning 850 W on a site budgeted in kilowatts would cut it to almost nothing.
    pub fn parse(text: &str) -> Result<Watts, PowerParseError> {
        let trimmed = text.trim();
        if trimmed.is_empty() {
            return Err(PowerParseError::Empty);
        }
        let split = trimmed
            .find(|c: char| c.is_ascii_alphabetic())
            .unwrap_or(trimmed.len());
        let (number, unit) = trimmed.split_at(split);
        let value: f64 = number
            .trim()
            .parse()
            .map_err(|_| PowerParseError::BadNumber(trimmed.to_string()))?;
        if !value.is_finite() || value < 0.0 {
            return Err(PowerParseError::BadNumber(trimmed.to_string()));
        }
        let scale = match unit.trim() {
            "" => return Err(PowerParseError::NoUnit(printable_share(trimmed))),
            "W" | "w" => 1.0,
            "kW" | "kw" | "KW" => 1e3,
            "MW" | "mw" => 1e6,
            other => return Err(PowerParseError::BadUnit(other.to_string())),
        };
        let watts = value * scale;
        if !watts.is_finite() || watts < 0.0 {
            return Err(PowerParseError::BadNumber(trimmed.to_string()));
        }
        Ok(Watts(watts))
    }
}

/// Why a power quantity such as `850kW` did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PowerParseError {
    #[error("empty power value; expected a number with W, kW or MW, e.g. 850kW")]
    Empty,
    #[error("\"{0}\" is not a non-negative power; expected a number with W, kW or MW, e.g. 850kW")]
    BadNumber(String),
    #[error("unknown power unit \"{0}\"; accepted: W, kW, MW")]
    BadUnit(String),
    #[error("\"{0}\" has no unit; accepted: a number with W, kW or MW, e.g. {0}kW or {0}W")]
    NoUnit(String),
}

/// Parses a share, written as a percentage (`30%`) or a fraction (`0.3`): both mean the
/// same in every command. A bare number above 1 (`30`) is refused, since it could mean
/// either 30 % or a share of 30. The result is a fraction.
pub fn parse_share(text: &str) -> Result<f64, ShareParseError> {
    let trimmed = text.trim();
    let bad = || ShareParseError::BadNumber(printable_share(trimmed));
    let (number, percent) = match trimmed.strip_suffix('%') {
        Some(n) => (n.trim(), true),
        None => (trimmed, false),
    };
    let value: f64 = number.parse().map_err(|_| bad())?;
    if !value.is_finite() || value < 0.0 {
        return Err(bad());
    }
    if percent {
        Ok(value / 100.0)
    } else if value > 1.0 {
        Err(ShareParseError::Ambiguous(printable_share(trimmed)))
    } else {
        Ok(value)
    }
}

/// User text shown in a message: at most 40 characters, control characters escaped.
fn printable_share(text: &str) -> String {
    text.chars()
        .take(40)
        .flat_map(char::escape_default)
        .collect()
}

/// Why a share such as `30%` or `0.3` did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShareParseError {
    #[error("\"{0}\" is not a share; accepted: a percentage (e.g. 30%) or a fraction (e.g. 0.3)")]
    BadNumber(String),
    #[error("\"{0}\" is a bare number above 1; write it as a percentage ({0}%) or a fraction (e.g. 0.3 for 30%)")]
    Ambiguous(String),
}

impl fmt::Display for Watts {
    /// Human form: `700 W`, `56.0 kW`, `1.20 MW`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let w = self.0;
        if w.abs() >= 1e6 {
            write!(f, "{:.2} MW", w / 1e6)
        } else if w.abs() >= 1e4 {
            write!(f, "{:.1} kW", w / 1e3)
        } else {
            write!(f, "{:.0} W", w)
        }
    }
}

impl Add for Watts {
    type Output = Watts;
    fn add(self, rhs: Watts) -> Watts {
        Watts(self.0 + rhs.0)
    }
}

impl AddAssign for Watts {
    fn add_assign(&mut self, rhs: Watts) {
        self.0 += rhs.0;
    }
}

impl Sub for Watts {
    type Output = Watts;
    fn sub(self, rhs: Watts) -> Watts {
        Watts(self.0 - rhs.0)
    }
}

impl SubAssign for Watts {
    fn sub_assign(&mut self, rhs: Watts) {
        self.0 -= rhs.0;
    }
}

impl Mul<f64> for Watts {
    type Output = Watts;
    fn mul(self, rhs: f64) -> Watts {
        Watts(self.0 * rhs)
    }
}

impl Div<f64> for Watts {
    type Output = Watts;
    fn div(self, rhs: f64) -> Watts {
        Watts(self.0 / rhs)
    }
}

impl Sum for Watts {
    fn sum<I: Iterator<Item = Watts>>(iter: I) -> Watts {
        Watts(iter.map(|w| w.0).sum())
    }
}

/// A slowdown bound as a fraction of uncapped throughput: 0.25 = "at most 25 % slower".
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SlowdownFraction(pub f64);

impl fmt::Display for SlowdownFraction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let pct = self.0 * 100.0;
        if (pct - pct.round()).abs() < 1e-9 {
            write!(f, "{:.0}%", pct)
        } else {
            write!(f, "{:.1}%", pct)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_power_with_units() {
        assert_eq!(Watts::parse("850kW"), Ok(Watts(850_000.0)));
        assert_eq!(Watts::parse("0.5 MW"), Ok(Watts(500_000.0)));
        assert_eq!(Watts::parse("700W"), Ok(Watts(700.0)));
        assert_eq!(
            Watts::parse("700"),
            Err(PowerParseError::NoUnit("700".into()))
        );
        assert_eq!(
            Watts::parse("-5"),
            Err(PowerParseError::BadNumber("-5".into())),
            "the sign is judged before the unit"
        );
        assert!(Watts::parse("850")
            .expect_err("no unit")
            .to_string()
            .contains("850kW or 850W"));
        assert_eq!(Watts::parse(""), Err(PowerParseError::Empty));
        assert_eq!(
            Watts::parse("5 GW"),
            Err(PowerParseError::BadUnit("GW".into()))
        );
        assert_eq!(
            Watts::parse("-3kW"),
            Err(PowerParseError::BadNumber("-3kW".into()))
        );
        assert_eq!(
            Watts::parse("abc"),
            Err(PowerParseError::BadNumber("abc".into()))
        );
    }

    #[test]
    fn displays_human_power() {
        assert_eq!(Watts(700.0).to_string(), "700 W");
        assert_eq!(Watts(56_000.0).to_string(), "56.0 kW");
        assert_eq!(Watts(1_200_000.0).to_string(), "1.20 MW");
        assert_eq!(SlowdownFraction(0.25).to_string(), "25%");
        assert_eq!(SlowdownFraction(0.125).to_string(), "12.5%");
    }

    /// A percentage and a fraction mean the same; a bare number above 1 says neither.
    #[test]
    fn a_share_is_a_percentage_or_a_fraction_never_a_bare_number_above_one() {
        assert_eq!(parse_share("30%"), Ok(0.3));
        assert_eq!(parse_share(" 30 % "), Ok(0.3));
        assert_eq!(parse_share("0.3"), Ok(0.3));
        assert_eq!(parse_share("1"), Ok(1.0));
        assert_eq!(parse_share("0.5%"), Ok(0.005));
        assert_eq!(
            parse_share("30"),
            Err(ShareParseError::Ambiguous("30".into()))
        );
        assert!(parse_share("30")
            .expect_err("ambiguous")
            .to_string()
            .contains("30%"));
        for bad in ["", "%", "lots", "-0.1", "NaN", "inf%", "0.3%%"] {
            assert!(
                matches!(parse_share(bad), Err(ShareParseError::BadNumber(_))),
                "{bad:?}"
            );
        }
    }
}
