//! The one way tests, benches and the demo write `powerflex.toml`.
//!
//! A [`SiteBuilder`] fills in [`RawSiteConfig`], the loader's own types, and serialises
//! them with `toml`: a renamed or removed key breaks the build of every caller instead of
//! failing a whole-system test at run time. [`SiteBuilder::write`] parses and validates
//! the text it is about to write with the real loader ([`SiteConfig::from_toml_str`]),
//! so a config the daemons would refuse never reaches them by accident. The fault tests
//! that write an invalid config on purpose go through [`edit_site_file`], which checks
//! only that the file still parses.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use powerflex_core::allocate::Policy;
use powerflex_core::config::{ConfigError, RawGpuModel, RawSiteConfig, SiteConfig};

/// A site config under construction. Starts from a small, valid site: the given budget,
/// policy `optimal`, jobs without `--power-flex` unmanaged, one simulated `H200` model
/// (200 to 700 W in 10 W steps, calibration walk 700/600/500 W, fail-safe cap 500 W), and
/// a controller address on the discard port (standalone agents never dial it). Every
/// other key is left out, so the loader's default applies.
#[derive(Debug, Clone)]
pub struct SiteBuilder {
    raw: RawSiteConfig,
    header: String,
}

/// Why a site config was not written.
#[derive(Debug)]
pub enum SiteError {
    /// The loader refuses it; the message names the key and what is accepted.
    Invalid(ConfigError),
    /// The raw config cannot be written as TOML.
    Serialize(toml::ser::Error),
    /// The file cannot be written or read.
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl fmt::Display for SiteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SiteError::Invalid(e) => {
                write!(f, "the site config the test bed built is invalid: {e}")
            }
            SiteError::Serialize(e) => write!(f, "cannot write the site config as toml: {e}"),
            SiteError::Io { path, source } => write!(f, "{}: {source}", path.display()),
        }
    }
}

impl std::error::Error for SiteError {}

/// Per-GPU limits of the simulated H200 (its NVML minimum and TDP), W.
pub const H200_MIN_CAP_W: f64 = 200.0;
pub const H200_MAX_CAP_W: f64 = 700.0;

fn path_text(path: &Path) -> String {
    path.display().to_string()
}

impl SiteBuilder {
    pub fn new(gpu_budget_w: f64) -> SiteBuilder {
        let mut raw = RawSiteConfig::default();
        raw.facility.gpu_budget_w = gpu_budget_w;
        raw.facility.policy = Some(Policy::Optimal.name().to_string());
        raw.tiers.default = Some("none".to_string());
        raw.controller.listen = "127.0.0.1:9".to_string();
        let builder = SiteBuilder {
            raw,
            header: String::new(),
        };
        builder.h200(&[700.0, 600.0, 500.0], 500.0)
    }

    /// Comment lines written at the top of the file (each prefixed with `# `).
    pub fn header(mut self, text: &str) -> SiteBuilder {
        self.header = text.lines().map(|l| format!("# {l}\n")).collect();
        self
    }

    pub fn policy(mut self, policy: Policy) -> SiteBuilder {
        self.raw.facility.policy = Some(policy.name().to_string());
        self
    }

    /// Replaces the GPU models with one `H200` (200 to 700 W, 10 W steps) walking
    /// `calibration_caps_w` with fail-safe cap `failsafe_cap_w`.
    pub fn h200(self, calibration_caps_w: &[f64], failsafe_cap_w: f64) -> SiteBuilder {
        self.gpu_model(
            "H200",
            RawGpuModel {
                min_cap_w: H200_MIN_CAP_W,
                max_cap_w: H200_MAX_CAP_W,
                cap_step_w: 10.0,
                calibration_caps_w: calibration_caps_w.to_vec(),
                failsafe_cap_w,
            },
        )
    }

    /// Replaces the GPU models with `model` named `name`.
    pub fn gpu_model(mut self, name: &str, model: RawGpuModel) -> SiteBuilder {
        self.raw.gpu_models.clear();
        self.raw.gpu_models.insert(name.to_string(), model);
        self
    }

    /// The controller's address, lease and allocation period.
    pub fn controller(
        mut self,
        listen: SocketAddr,
        lease_ttl_s: u64,
        allocation_period_s: u64,
    ) -> SiteBuilder {
        self.raw.controller.listen = listen.to_string();
        self.raw.controller.lease_ttl_s = Some(lease_ttl_s);
        self.raw.controller.allocation_period_s = Some(allocation_period_s);
        self
    }

    /// `controller.job_placement = "reports"`: the controller believes every node about
    /// what it reports. Only for a controller with no Slurm beside it (harness agents on
    /// the real link); everything on a real cluster keeps the default, Slurm's record.
    pub fn placement_from_reports(mut self) -> SiteBuilder {
        self.raw.controller.job_placement = Some("reports".into());
        self
    }

    /// Where the site key is (the controller reads it), and the nodes' own link keys
    /// beside it, `node-%n.key` (see [`crate::write_node_keys`]).
    pub fn key_file(mut self, path: &Path) -> SiteBuilder {
        self.raw.controller.key_file = Some(path_text(path));
        let dir = path.parent().unwrap_or(Path::new("/"));
        self.raw.agent.key_file = Some(path_text(&dir.join("node-%n.key")));
        self
    }

    /// The controller's admin socket and state directory.
    pub fn controller_paths(mut self, admin_socket: &Path, state_dir: &Path) -> SiteBuilder {
        self.raw.controller.admin_socket = Some(path_text(admin_socket));
        self.raw.controller.state_dir = Some(path_text(state_dir));
        self
    }

    pub fn controller_metrics(mut self, listen: SocketAddr) -> SiteBuilder {
        self.raw.controller.metrics_listen = Some(listen.to_string());
        self
    }

    /// The agent's socket and state-directory patterns (`%n` = node name) and the NVML
    /// library it loads (the simulated one in every test).
    pub fn agent_paths(
        mut self,
        socket: &str,
        state_dir: &str,
        nvml_library: &Path,
    ) -> SiteBuilder {
        self.raw.agent.socket = Some(socket.to_string());
        self.raw.agent.state_dir = Some(state_dir.to_string());
        self.raw.agent.nvml_library = Some(path_text(nvml_library));
        self
    }

    pub fn agent_metrics(mut self, listen: SocketAddr) -> SiteBuilder {
        self.raw.agent.metrics_listen = Some(listen.to_string());
        self
    }

    /// Calibration timing, seconds: warm-up before the walk, settle and hold per cap.
    pub fn calibration_s(mut self, warmup_s: f64, settle_s: f64, hold_s: f64) -> SiteBuilder {
        self.raw.agent.calibration_warmup_s = Some(warmup_s);
        self.raw.agent.calibration_settle_s = Some(settle_s);
        self.raw.agent.calibration_hold_s = Some(hold_s);
        self
    }

    /// The calibration design's token budget, percent of a job's first-hour tokens. A
    /// test bed's short windows make many windows affordable at the default 2 %; a
    /// smaller budget keeps the walk to a window or two per cap, so it ends in seconds.
    pub fn calibration_budget_pct(mut self, pct: f64) -> SiteBuilder {
        self.raw.agent.calibration_budget_pct = Some(pct);
        self
    }

    /// Any other key: the raw config, to change in place.
    pub fn edit(mut self, edit: impl FnOnce(&mut RawSiteConfig)) -> SiteBuilder {
        edit(&mut self.raw);
        self
    }

    /// The file's text, after the real loader has accepted it.
    pub fn to_toml(&self) -> Result<String, SiteError> {
        self.checked().map(|(text, _)| text)
    }

    /// Writes the file and returns the config the daemons will load from it.
    pub fn write(&self, path: &Path) -> Result<SiteConfig, SiteError> {
        let (text, config) = self.checked()?;
        std::fs::write(path, text).map_err(|source| SiteError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(config)
    }

    fn checked(&self) -> Result<(String, SiteConfig), SiteError> {
        let body = toml::to_string(&self.raw).map_err(SiteError::Serialize)?;
        let text = format!("{}{body}", self.header);
        let config = SiteConfig::from_toml_str(&text).map_err(SiteError::Invalid)?;
        Ok((text, config))
    }
}

/// Reads the site config at `path`, changes it with `edit` and writes it back. The
/// result is checked to parse (the loader's first step) but not validated: the fault
/// tests write out-of-range values on purpose to see a reload refused.
pub fn edit_site_file(path: &Path, edit: impl FnOnce(&mut RawSiteConfig)) -> Result<(), SiteError> {
    let io = |source| SiteError::Io {
        path: path.to_path_buf(),
        source,
    };
    let text = std::fs::read_to_string(path).map_err(io)?;
    let mut raw = RawSiteConfig::from_toml_str(&text).map_err(SiteError::Invalid)?;
    edit(&mut raw);
    let text = toml::to_string(&raw).map_err(SiteError::Serialize)?;
    RawSiteConfig::from_toml_str(&text).map_err(SiteError::Invalid)?;
    std::fs::write(path, text).map_err(io)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use powerflex_core::units::Watts;

    #[test]
    fn the_starting_site_is_what_the_loader_reads() {
        let text = SiteBuilder::new(5600.0)
            .header("a test site")
            .to_toml()
            .unwrap();
        assert!(text.starts_with("# a test site\n"), "{text}");
        let site = SiteConfig::from_toml_str(&text).unwrap();
        assert_eq!(site.facility.gpu_budget_w, Watts(5600.0));
        assert_eq!(site.facility.policy, Policy::Optimal);
        let h200 = site.gpu_model_for("NVIDIA H200").unwrap();
        assert_eq!(h200.failsafe_cap_w, Watts(500.0));
        assert_eq!(h200.calibration_caps_w.len(), 3);
        // Keys the builder was not told about keep the loader's defaults.
        assert_eq!(site.controller.lease_ttl_s, 60);
        assert!(site.agent.metrics_listen.is_none());
    }

    #[test]
    fn every_setter_lands_in_the_loaded_config() {
        let dir = Path::new("/tmp/pf-site");
        let site = SiteBuilder::new(16800.0)
            .policy(Policy::Equal)
            .h200(&[700.0, 400.0], 300.0)
            .controller("127.0.0.1:7300".parse().unwrap(), 10, 1)
            .key_file(&dir.join("site.key"))
            .controller_paths(&dir.join("ctld.sock"), &dir.join("ctld"))
            .controller_metrics("127.0.0.1:9465".parse().unwrap())
            .agent_paths(
                "/tmp/pf-site/%n.sock",
                "/tmp/pf-site/state/%n",
                Path::new("/x/libnvml.so"),
            )
            .agent_metrics("127.0.0.1:9464".parse().unwrap())
            .calibration_s(1.0, 2.0, 3.0)
            .edit(|raw| raw.agent.node_budget_w = Some(1000.0));
        let text = site.to_toml().unwrap();
        let c = SiteConfig::from_toml_str(&text).unwrap();
        assert_eq!(c.facility.policy, Policy::Equal);
        assert_eq!(c.gpu_models[0].failsafe_cap_w, Watts(300.0));
        assert_eq!(c.controller.listen.port(), 7300);
        assert_eq!(
            (c.controller.lease_ttl_s, c.controller.allocation_period_s),
            (10, 1)
        );
        assert_eq!(c.controller.key_file, dir.join("site.key"));
        assert_eq!(c.agent.key_file("n1"), dir.join("node-n1.key"));
        assert_eq!(c.controller.admin_socket, dir.join("ctld.sock"));
        assert_eq!(c.controller.state_dir, dir.join("ctld"));
        assert_eq!(c.controller.metrics_listen.map(|a| a.port()), Some(9465));
        assert_eq!(c.agent.socket_path("n1"), dir.join("n1.sock"));
        assert_eq!(c.agent.state_dir("n1"), dir.join("state/n1"));
        assert_eq!(
            c.agent.nvml_library.as_deref(),
            Some(Path::new("/x/libnvml.so"))
        );
        assert_eq!(c.agent.metrics_listen.map(|a| a.port()), Some(9464));
        assert_eq!(
            (
                c.agent.calibration_warmup_s,
                c.agent.calibration_settle_s,
                c.agent.calibration_hold_s
            ),
            (1.0, 2.0, 3.0)
        );
        assert_eq!(c.agent.node_budget_w, Some(Watts(1000.0)));
    }

    #[test]
    fn an_invalid_site_is_refused_with_the_loaders_message() {
        let err = SiteBuilder::new(-5.0).to_toml().unwrap_err();
        assert!(
            matches!(&err, SiteError::Invalid(ConfigError::OutOfRange { key, .. }) if key == "facility.gpu_budget_w"),
            "{err}"
        );
        // A lease shorter than two allocation periods is the loader's cross-field rule.
        let err = SiteBuilder::new(100.0)
            .controller("127.0.0.1:7300".parse().unwrap(), 5, 10)
            .to_toml()
            .unwrap_err();
        assert!(
            matches!(
                err,
                SiteError::Invalid(ConfigError::LeaseTooShort {
                    lease_ttl_s: 5,
                    allocation_period_s: 10
                })
            ),
            "{err}"
        );
    }

    #[test]
    fn an_edit_may_write_an_invalid_value_but_not_unparsable_text() {
        let dir = std::env::temp_dir().join(format!("pf-site-edit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("powerflex.toml");
        SiteBuilder::new(3000.0).write(&path).unwrap();
        edit_site_file(&path, |raw| raw.facility.gpu_budget_w = -5.0).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(
            RawSiteConfig::from_toml_str(&text)
                .unwrap()
                .facility
                .gpu_budget_w,
            -5.0
        );
        assert!(matches!(
            SiteConfig::from_toml_str(&text),
            Err(ConfigError::OutOfRange { .. })
        ));
        let missing = dir.join("missing.toml");
        assert!(matches!(
            edit_site_file(&missing, |_| {}),
            Err(SiteError::Io { .. })
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
