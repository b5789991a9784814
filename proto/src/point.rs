//! How a job's curve points travel: core's [`OperatingPoint`] (per-GPU cap, the job's
//! summed power on the node, its throughput) written as the 3-element array
//! `[cap_w, power_w, throughput]` that reports, statuses and the agent's saved state of
//! every release hold. A field opts in with `#[serde(with = "...")]`, so a report or a
//! saved file written by the current release is read by the next and the other way
//! round, while the code reads named fields in core's units.

use std::collections::BTreeMap;

use powerflex_core::point::OperatingPoint;
use powerflex_core::Watts;
use serde::{Deserialize, Deserializer, Serializer};

/// The wire form of one point: `[cap_w, power_w, throughput]`.
pub fn to_array(p: &OperatingPoint) -> [f64; 3] {
    [p.cap_w.0, p.power_w.0, p.throughput]
}

/// The point a wire array `[cap_w, power_w, throughput]` holds.
pub fn from_array([cap_w, power_w, throughput]: [f64; 3]) -> OperatingPoint {
    OperatingPoint {
        cap_w: Watts(cap_w),
        power_w: Watts(power_w),
        throughput,
    }
}

/// A list of points, as a list of `[cap_w, power_w, throughput]` arrays.
pub mod arrays {
    use super::*;

    pub fn serialize<S: Serializer>(points: &[OperatingPoint], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(points.iter().map(to_array))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<OperatingPoint>, D::Error> {
        Ok(Vec::<[f64; 3]>::deserialize(d)?
            .into_iter()
            .map(from_array)
            .collect())
    }
}

/// Lists of points by node name, each as [`arrays`] writes it.
pub mod arrays_by_node {
    use super::*;

    pub fn serialize<S: Serializer>(
        points: &BTreeMap<String, Vec<OperatingPoint>>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.collect_map(
            points
                .iter()
                .map(|(node, list)| (node, list.iter().map(to_array).collect::<Vec<_>>())),
        )
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<BTreeMap<String, Vec<OperatingPoint>>, D::Error> {
        Ok(BTreeMap::<String, Vec<[f64; 3]>>::deserialize(d)?
            .into_iter()
            .map(|(node, list)| (node, list.into_iter().map(from_array).collect()))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Serialize;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Holder {
        #[serde(with = "arrays")]
        points: Vec<OperatingPoint>,
        #[serde(with = "arrays_by_node")]
        by_node: BTreeMap<String, Vec<OperatingPoint>>,
    }

    fn point(cap_w: f64, power_w: f64, throughput: f64) -> OperatingPoint {
        from_array([cap_w, power_w, throughput])
    }

    #[test]
    fn points_travel_as_the_release_s_three_numbers_both_ways() {
        // As reports, statuses and saved files of the current release hold them.
        let line = r#"{"points":[[700.0,1300.0,5200.5],[400.0,790.0,4100.0]],"by_node":{"n1":[[650.0,1250.0,5000.0]],"n2":[]}}"#;
        let held: Holder = serde_json::from_str(line).expect("reads");
        assert_eq!(
            held,
            Holder {
                points: vec![point(700.0, 1300.0, 5200.5), point(400.0, 790.0, 4100.0)],
                by_node: [
                    ("n1".to_string(), vec![point(650.0, 1250.0, 5000.0)]),
                    ("n2".to_string(), Vec::new()),
                ]
                .into(),
            }
        );
        assert_eq!(serde_json::to_string(&held).expect("writes"), line);
        // A point is exactly three numbers.
        let short = r#"{"points":[[700.0,1300.0]],"by_node":{}}"#;
        assert!(serde_json::from_str::<Holder>(short).is_err());
    }
}
