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

    /// Parses `850kW`, `0.85 MW`, `700W` or a bare number of watts.
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
        let scale = match unit.trim() {
            "" | "W" | "w" => 1.0,
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
        assert_eq!(Watts::parse("700"), Ok(Watts(700.0)));
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
}
