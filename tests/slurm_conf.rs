//! Every file in slurm-conf/ is exercised: the systemd units start the binaries we build
//! with flags those binaries accept, and point at the config path the binaries default to;
//! plugstack.conf's arguments parse; the slurm.conf and gres.conf snippets declare the same
//! GPUs.

use powerflex::{binary, repo_root, run};

/// `Key=Value` lines of a systemd unit's `[Service]` section.
fn service_keys(unit: &str) -> Vec<(String, String)> {
    let mut in_service = false;
    let mut keys = Vec::new();
    for line in unit.lines().map(str::trim) {
        if line.starts_with('[') {
            in_service = line == "[Service]";
            continue;
        }
        if in_service && !line.starts_with('#') {
            if let Some((k, v)) = line.split_once('=') {
                keys.push((k.trim().to_string(), v.trim().to_string()));
            }
        }
    }
    keys
}

#[test]
fn powerflexd_unit_starts_the_agent_with_flags_it_accepts() {
    let unit =
        std::fs::read_to_string(repo_root().join("slurm-conf/powerflexd.service")).expect("unit");
    let keys = service_keys(&unit);
    let exec = keys
        .iter()
        .find(|(k, _)| k == "ExecStart")
        .map(|(_, v)| v.clone())
        .expect("ExecStart");
    let mut words = exec.split_whitespace();
    let program = words.next().expect("program");
    assert!(program.ends_with("/powerflexd"), "{program}");
    let args: Vec<&str> = words.collect();
    assert_eq!(args, ["--config", "/etc/slurm/powerflex.toml"]);
    assert!(
        keys.iter()
            .any(|(k, v)| k == "KillSignal" && v == "SIGTERM"),
        "SIGTERM restores the GPUs"
    );
    assert!(
        keys.iter().any(|(k, v)| k == "User" && v == "root"),
        "NVML limits need root"
    );
    assert!(
        keys.iter()
            .any(|(k, v)| k == "RuntimeDirectory" && v == "powerflex"),
        "/run/powerflex for the sockets"
    );
    // The flags parse (a usage error would exit 2); the missing file is reported plainly.
    let agent = binary("powerflexd");
    let mut args_with_missing: Vec<&str> = args.clone();
    args_with_missing[1] = "/nonexistent/powerflex.toml";
    let out = run(&agent, &args_with_missing);
    assert_eq!(out.code, Some(1), "{}", out.stderr);
    assert!(
        out.stderr
            .contains("cannot read /nonexistent/powerflex.toml"),
        "{}",
        out.stderr
    );
    // The unit's defaults agree with the binary's.
    let help = run(&agent, &["--help"]);
    assert!(
        help.stdout.contains("/etc/slurm/powerflex.toml"),
        "{}",
        help.stdout
    );
    // And with the example site config's socket and state directories.
    let site = std::fs::read_to_string(repo_root().join("slurm-conf/powerflex.toml"))
        .expect("site config");
    assert!(site.contains("socket = \"/run/powerflex/%n.sock\""));
    assert!(site.contains("state_dir = \"/var/lib/powerflex/%n\""));
    assert!(unit.contains("StateDirectory=powerflex"));
}

#[test]
fn plugstack_loads_the_plugin_optionally_with_valid_arguments() {
    let text = std::fs::read_to_string(repo_root().join("slurm-conf/plugstack.conf"))
        .expect("plugstack.conf");
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    assert_eq!(lines.len(), 1, "{lines:?}");
    let words: Vec<String> = lines[0].split_whitespace().map(str::to_string).collect();
    assert_eq!(
        words[0], "optional",
        "never required: a plugin error must not drain nodes"
    );
    assert!(words[1].ends_with("/power_flex.so"));
    let args = power_flex::logic::parse_args(&words[2..]).expect("the shipped arguments parse");
    assert_eq!(args.socket, "/run/powerflex/%n.sock");
    assert_eq!(args.timeout, std::time::Duration::from_millis(200));
    // The site config it names is the one the agent's unit reads; its socket matches.
    assert_eq!(
        args.site.as_deref(),
        Some(std::path::Path::new("/etc/slurm/powerflex.toml"))
    );
    let site =
        std::fs::read_to_string(repo_root().join("slurm-conf/powerflex.toml")).expect("site");
    assert!(site.contains(&format!("socket = \"{}\"", args.socket)));
}

#[test]
fn powerflex_ctld_unit_starts_the_controller_with_flags_it_accepts() {
    let unit = std::fs::read_to_string(repo_root().join("slurm-conf/powerflex-ctld.service"))
        .expect("unit");
    let keys = service_keys(&unit);
    let exec = keys
        .iter()
        .find(|(k, _)| k == "ExecStart")
        .map(|(_, v)| v.clone())
        .expect("ExecStart");
    let words: Vec<&str> = exec.split_whitespace().collect();
    assert!(words[0].ends_with("/powerflex-ctld"), "{exec}");
    assert_eq!(words[1..], ["--config", "/etc/slurm/powerflex.toml"]);
    let ctld = binary("powerflex-ctld");
    let out = run(&ctld, &["--config", "/nonexistent/powerflex.toml"]);
    assert_eq!(out.code, Some(1), "{}", out.stderr);
    assert!(
        out.stderr
            .contains("cannot read /nonexistent/powerflex.toml"),
        "{}",
        out.stderr
    );
    // The state directory and admin socket agree with the example site config.
    let site =
        std::fs::read_to_string(repo_root().join("slurm-conf/powerflex.toml")).expect("site");
    assert!(
        site.contains("state_dir = \"/var/lib/powerflex/ctld\"")
            && unit.contains("StateDirectory=powerflex/ctld")
    );
    assert!(
        site.contains("admin_socket = \"/run/powerflex/ctld.sock\"")
            && unit.contains("RuntimeDirectory=powerflex")
    );
}

#[test]
fn powerflex_grid_unit_starts_the_ven_with_flags_it_accepts() {
    let unit = std::fs::read_to_string(repo_root().join("slurm-conf/powerflex-grid.service"))
        .expect("unit");
    let keys = service_keys(&unit);
    let exec = keys
        .iter()
        .find(|(k, _)| k == "ExecStart")
        .map(|(_, v)| v.clone())
        .expect("ExecStart");
    let words: Vec<&str> = exec.split_whitespace().collect();
    assert!(words[0].ends_with("/powerflex-grid"), "{exec}");
    assert_eq!(words[1..], ["--config", "/etc/slurm/powerflex.toml"]);
    let grid = binary("powerflex-grid");
    let out = run(&grid, &["--config", "/nonexistent/powerflex.toml"]);
    assert_eq!(out.code, Some(2), "{}", out.stderr);
    assert!(
        out.stderr.contains("/nonexistent/powerflex.toml"),
        "{}",
        out.stderr
    );
    // The state directory agrees with the example site config's [grid.openadr].
    let site =
        std::fs::read_to_string(repo_root().join("slurm-conf/powerflex.toml")).expect("site");
    assert!(
        site.contains("state_dir = \"/var/lib/powerflex/grid\"")
            && unit.contains("StateDirectory=powerflex/grid")
    );
}

/// Non-comment lines of a Slurm config file.
fn config_lines(file: &str) -> Vec<String> {
    std::fs::read_to_string(repo_root().join("slurm-conf").join(file))
        .unwrap_or_else(|e| panic!("{file}: {e}"))
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_string)
        .collect()
}

#[test]
fn slurm_and_gres_snippets_declare_the_same_gpus_the_plugin_reads() {
    let slurm = config_lines("slurm.conf.snippet");
    assert!(slurm.contains(&"GresTypes=gpu".to_string()), "{slurm:?}");
    // The plugin stack file is where plugstack.conf's own header says to install it.
    assert!(
        slurm.contains(&"PlugStackConfig=/etc/slurm/plugstack.conf".to_string()),
        "{slurm:?}"
    );
    let node = slurm
        .iter()
        .find(|l| l.starts_with("NodeName="))
        .expect("a NodeName line");
    let per_node: u32 = node
        .split_whitespace()
        .find_map(|w| w.strip_prefix("Gres=gpu:"))
        .and_then(|n| n.parse().ok())
        .expect("Gres=gpu:N on the node line");
    let gres = config_lines("gres.conf.snippet");
    assert_eq!(
        gres,
        vec![format!("Name=gpu File=/dev/nvidia[0-{}]", per_node - 1)],
        "gres.conf names exactly the {per_node} GPUs slurm.conf declares"
    );
    let plugstack = std::fs::read_to_string(repo_root().join("slurm-conf/plugstack.conf"))
        .expect("plugstack.conf");
    assert!(plugstack.contains("/etc/slurm/plugstack.conf"));
}

/// The key distribution the example config and README describe: the site key on the
/// controller's host, `powerflexctl link-key` writing each node's own key (root, 0600)
/// for `agent.key_file`; the agent's unit reads that file.
#[test]
fn link_key_writes_each_nodes_own_key_from_the_example_site_config() {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("pf-link-key-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    let example =
        std::fs::read_to_string(repo_root().join("slurm-conf/powerflex.toml")).expect("site");
    assert!(example.contains("key_file = \"/etc/slurm/powerflex.key\""));
    assert!(example.contains("key_file = \"/etc/powerflex/node.key\""));
    let unit =
        std::fs::read_to_string(repo_root().join("slurm-conf/powerflexd.service")).expect("unit");
    assert!(unit.contains("agent.key_file"), "{unit}");
    let site_key = dir.join("powerflex.key");
    let config = dir.join("powerflex.toml");
    std::fs::write(
        &config,
        example.replace("/etc/slurm/powerflex.key", &site_key.display().to_string()),
    )
    .expect("config");
    std::fs::write(&site_key, "0123456789abcdef0123456789abcdef\n").expect("key");
    let ctl = binary("powerflexctl");
    let link_key = |node: &str, out: &std::path::Path| {
        run(
            &ctl,
            &[
                "link-key",
                "--site",
                config.to_str().expect("utf-8"),
                "--node",
                node,
                "--out",
                out.to_str().expect("utf-8"),
            ],
        )
    };
    // A site key others can read is refused, naming what is accepted.
    std::fs::set_permissions(&site_key, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let open = link_key("gpu001", &dir.join("gpu001.key"));
    assert_eq!(open.code, Some(1), "{}", open.stderr);
    assert!(
        open.stderr.contains("accepted: 600 or stricter"),
        "{}",
        open.stderr
    );
    std::fs::set_permissions(&site_key, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let mut keys = Vec::new();
    for node in ["gpu001", "gpu002"] {
        let out = dir.join(format!("{node}.key"));
        let made = link_key(node, &out);
        assert_eq!(made.code, Some(0), "{}", made.stderr);
        assert!(made.stdout.contains("agent.key_file"), "{}", made.stdout);
        let mode = std::fs::metadata(&out).expect("key").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        // What the agent reads is the key the controller derives for that node.
        let read = powerflex_daemon::fsx::read_key_file(&out).expect("a valid key file");
        assert_eq!(
            read,
            powerflex_proto::link::node_key(b"0123456789abcdef0123456789abcdef", node)
                .expect("derived")
        );
        keys.push(read);
    }
    assert_ne!(keys[0], keys[1], "each node its own key");
    let bad = link_key("gpu 1", &dir.join("bad.key"));
    assert_eq!(
        bad.code,
        Some(2),
        "a bad node name is a usage error: {}",
        bad.stderr
    );
    assert!(
        bad.stderr.contains("accepted: 1-64 ASCII letters"),
        "{}",
        bad.stderr
    );
    let _ = std::fs::remove_dir_all(&dir);
}
