//! The site config reference, generated from the config types themselves: the JSON
//! Schema that `schemars` derives from `powerflex_core::config::RawSiteConfig` ([`file_schema`]) carries each
//! field's doc comment, its type and whether it is required, so a key added to the types
//! is in the reference (and in `powerflex.toml(5)`) the moment it is built, and a key
//! removed from them is gone from it. `powerflexctl reference config` prints it;
//! `docs/reference/config.md` is its Markdown form, checked against it by a test.
//!
//! The schema is walked here only to render documentation: it is read as
//! `serde_json::Value` because it is schemars' output format, not a protocol of ours.

use serde_json::Value;

use powerflex_core::config::file_schema;

/// One table of the config file: `[controller]`, `[gpu_models.<NAME>]`, `[[tiers.tier]]`.
#[derive(Debug, Clone, PartialEq)]
pub struct TableDoc {
    /// As written in the file: `[controller.database]`.
    pub heading: String,
    /// What the table is for (the field's or the type's doc comment).
    pub doc: String,
    /// Whether the file must have it.
    pub required: bool,
    pub keys: Vec<KeyDoc>,
}

/// One key of a table.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyDoc {
    pub name: String,
    /// `number`, `integer`, `string`, `boolean`, `array of numbers`, `table of strings`.
    pub value: String,
    /// The unit its name carries (`_w` watts, `_s` seconds, ...), when it carries one.
    pub unit: Option<&'static str>,
    pub required: bool,
    pub doc: String,
}

/// The unit a key's name ends in: every key carries its unit in its name.
pub fn unit_of(key: &str) -> Option<&'static str> {
    const SUFFIXES: &[(&str, &str)] = &[
        ("_w_per_s", "W/s"),
        ("_kw", "kW"),
        ("_w", "W"),
        ("_ms", "ms"),
        ("_s", "s"),
        ("_pct", "%"),
    ];
    SUFFIXES
        .iter()
        .find(|(suffix, _)| key.ends_with(suffix))
        .map(|(_, unit)| *unit)
}

/// Every table of the site config; tables and keys in alphabetical order (the schema's
/// order).
pub fn site_config_tables() -> Vec<TableDoc> {
    let schema = file_schema();
    let mut tables = Vec::new();
    walk_table(&schema, &schema, "", "", true, &mut tables);
    tables
}

/// The schema node `$ref` points to (or the node itself), with an `anyOf [T, null]`
/// (an optional table) unwrapped to `T`.
fn resolve<'a>(root: &'a Value, node: &'a Value) -> &'a Value {
    if let Some(reference) = node.get("$ref").and_then(Value::as_str) {
        let name = reference.rsplit('/').next().unwrap_or("");
        if let Some(target) = root.get("$defs").and_then(|d| d.get(name)) {
            return resolve(root, target);
        }
    }
    if let Some(options) = node.get("anyOf").and_then(Value::as_array) {
        let not_null: Vec<&Value> = options
            .iter()
            .filter(|o| o.get("type").and_then(Value::as_str) != Some("null"))
            .collect();
        if let [only] = not_null.as_slice() {
            return resolve(root, only);
        }
    }
    node
}

fn description(node: &Value) -> Option<String> {
    node.get("description")
        .and_then(Value::as_str)
        .map(|d| d.replace('\n', " "))
}

/// A node's JSON types, `null` left out (an optional key).
fn types(node: &Value) -> Vec<&str> {
    match node.get("type") {
        Some(Value::String(t)) => vec![t.as_str()],
        Some(Value::Array(ts)) => ts
            .iter()
            .filter_map(Value::as_str)
            .filter(|t| *t != "null")
            .collect(),
        _ => Vec::new(),
    }
}

fn is_table(node: &Value) -> bool {
    node.get("properties").is_some()
}

fn value_name(root: &Value, node: &Value) -> String {
    let node = resolve(root, node);
    let ty = types(node);
    match ty.first().copied() {
        Some("array") => {
            let items = node.get("items").map(|i| value_name(root, i));
            format!("array of {}s", items.unwrap_or_else(|| "value".into()))
        }
        Some("object") => {
            let values = node
                .get("additionalProperties")
                .map(|v| value_name(root, v));
            format!("table of {}s", values.unwrap_or_else(|| "value".into()))
        }
        Some(t) => t.to_string(),
        None => "value".to_string(),
    }
}

fn walk_table(
    root: &Value,
    node: &Value,
    heading: &str,
    doc: &str,
    required: bool,
    out: &mut Vec<TableDoc>,
) {
    let node = resolve(root, node);
    let Some(properties) = node.get("properties").and_then(Value::as_object) else {
        return;
    };
    let required_keys: Vec<&str> = node
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let doc = if doc.is_empty() {
        description(node).unwrap_or_default()
    } else {
        doc.to_string()
    };
    let index = out.len();
    out.push(TableDoc {
        heading: heading.to_string(),
        doc,
        required,
        keys: Vec::new(),
    });
    let join = |name: &str| {
        if heading.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", heading.trim_matches(|c| c == '[' || c == ']'))
        }
    };
    for (name, property) in properties {
        let target = resolve(root, property);
        let key_required = required_keys.contains(&name.as_str());
        let doc = description(property).unwrap_or_default();
        let items = target.get("items").map(|i| resolve(root, i));
        let values = target.get("additionalProperties").map(|v| resolve(root, v));
        if is_table(target) {
            let path = format!("[{}]", join(name));
            walk_table(root, target, &path, &doc, key_required, out);
        } else if let Some(item) = items.filter(|i| is_table(i)) {
            let path = format!("[[{}]]", join(name));
            walk_table(root, item, &path, &doc, key_required, out);
        } else if let Some(value) = values.filter(|v| is_table(v)) {
            let path = format!("[{}.<NAME>]", join(name));
            walk_table(root, value, &path, &doc, key_required, out);
        } else {
            out[index].keys.push(KeyDoc {
                name: name.clone(),
                value: value_name(root, property),
                unit: unit_of(name),
                required: key_required,
                doc,
            });
        }
    }
}

/// A doc comment for roff: code spans lose their backticks.
fn plain(text: &str) -> String {
    text.replace('`', "")
}

/// The reference as Markdown (`docs/reference/config.md`).
pub fn render_markdown(tables: &[TableDoc]) -> String {
    let mut out = String::from(
        "# powerflex.toml: the site config reference\n\n\
         Generated by `powerflexctl reference config --format markdown` from the config \
         types' own doc comments (`core/src/config.rs`); `tests/docs.rs` fails when this \
         file and the types differ, so edit the types, then regenerate it. The same text \
         is `man 5 powerflex.toml`. An annotated example of every key is \
         [`slurm-conf/powerflex.toml`](../../slurm-conf/powerflex.toml).\n\n\
         Every key carries its unit in its name (`_w` watts, `_s` seconds, `_ms` \
         milliseconds, `_pct` percent, `_kw` kilowatts). Unknown keys are errors, so a \
         typo is caught when the file is read, not ignored.\n",
    );
    for table in tables.iter().filter(|t| !t.heading.is_empty()) {
        let required = if table.required { " (required)" } else { "" };
        out.push_str(&format!("\n## `{}`{required}\n\n", table.heading));
        if !table.doc.is_empty() {
            out.push_str(&table.doc);
        }
        out.push('\n');
        if !table.keys.is_empty() {
            out.push_str("\n| key | value | unit | required | what it is |\n| --- | --- | --- | --- | --- |\n");
            for key in &table.keys {
                out.push_str(&format!(
                    "| `{}` | {} | {} | {} | {} |\n",
                    key.name,
                    key.value,
                    key.unit.unwrap_or(""),
                    if key.required { "yes" } else { "no" },
                    key.doc.replace('|', "\\|")
                ));
            }
        }
    }
    out
}

/// The reference as the man page `powerflex.toml(5)`.
pub fn render_man(tables: &[TableDoc], version: &str) -> String {
    use roff::{bold, italic, roman, Roff};
    let mut page = Roff::new();
    page.control(
        "TH",
        ["POWERFLEX.TOML", "5", "", &format!("powerflex {version}")],
    )
    .control("SH", ["NAME"])
    .text([roman("powerflex.toml - the powerflex site config")])
    .control("SH", ["SYNOPSIS"])
    .text([roman("/etc/slurm/powerflex.toml")])
    .control("SH", ["DESCRIPTION"])
    .text([roman(
        "One TOML file, the same on every host, read by powerflexd(8), powerflex-ctld(8), \
         powerflex-grid(8), powerflexctl(1) and the SPANK plugin. Every key carries its \
         unit in its name (_w watts, _s seconds, _ms milliseconds, _pct percent, _kw \
         kilowatts). Unknown keys are errors. Generated from the config types, as is \
         docs/reference/config.md.",
    )]);
    for table in tables.iter().filter(|t| !t.heading.is_empty()) {
        let heading = if table.required {
            format!("{} (required)", table.heading)
        } else {
            table.heading.clone()
        };
        page.control("SH", [heading.as_str()]);
        let doc = plain(&table.doc);
        if !doc.is_empty() {
            page.text([roman(doc)]);
        }
        for key in &table.keys {
            let mut what = vec![key.value.clone()];
            if let Some(unit) = key.unit {
                what.push(unit.to_string());
            }
            if key.required {
                what.push("required".to_string());
            }
            page.control("TP", [] as [&str; 0])
                .text([
                    bold(key.name.as_str()),
                    roman(" ("),
                    italic(what.join(", ")),
                    roman(")"),
                ])
                .text([roman(plain(&key.doc))]);
        }
    }
    page.control("SH", ["SEE ALSO"]).text([roman(
        "powerflexctl(1), powerflexd(8), powerflex-ctld(8), powerflex-grid(8), slurm.conf(5)",
    )]);
    page.render()
}

/// The metrics reference as Markdown (`docs/reference/metrics.md`), from the catalog
/// both daemons export from.
pub fn render_metrics_markdown() -> String {
    use powerflex_daemon::prom::catalog;
    let mut out = String::from(
        "# Metrics: the reference\n\n\
         Generated by `powerflexctl reference metrics` from the catalog both daemons export \
         from (`daemon/src/prom.rs`); `tests/docs.rs` fails when this file and the catalog \
         differ. Each daemon serves them at `http://ADDRESS/metrics` when its \
         `metrics_listen` is set (`agent.metrics_listen`, `controller.metrics_listen`; \
         loopback only). No user name or uid is ever a label value.\n",
    );
    for exporter in [catalog::Exporter::Agent, catalog::Exporter::Controller] {
        out.push_str(&format!(
            "\n## `{}`\n\n| name | type | labels | what it is |\n| --- | --- | --- | --- |\n",
            exporter.daemon()
        ));
        for family in catalog::all().iter().filter(|f| f.exporter == exporter) {
            out.push_str(&format!(
                "| `{}` | {} | {} | {} |\n",
                family.name,
                family.kind.as_str(),
                family
                    .labels
                    .iter()
                    .map(|l| format!("`{l}`"))
                    .collect::<Vec<_>>()
                    .join(", "),
                family.help.replace('|', "\\|")
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table<'a>(tables: &'a [TableDoc], heading: &str) -> &'a TableDoc {
        tables
            .iter()
            .find(|t| t.heading == heading)
            .unwrap_or_else(|| panic!("no {heading} in {:?}", headings(tables)))
    }

    fn headings(tables: &[TableDoc]) -> Vec<&str> {
        tables.iter().map(|t| t.heading.as_str()).collect()
    }

    #[test]
    fn every_table_of_the_file_is_found_with_its_shape() {
        let tables = site_config_tables();
        for heading in [
            "[facility]",
            "[tiers]",
            "[[tiers.tier]]",
            "[gpu_models.<NAME>]",
            "[controller]",
            "[controller.database]",
            "[agent]",
            "[predictor]",
            "[grid]",
            "[grid.openadr]",
        ] {
            table(&tables, heading);
        }
        assert!(table(&tables, "[facility]").required);
        assert!(!table(&tables, "[agent]").required);
    }

    #[test]
    fn keys_carry_their_doc_type_unit_and_whether_required() {
        let tables = site_config_tables();
        let facility = table(&tables, "[facility]");
        let budget = facility
            .keys
            .iter()
            .find(|k| k.name == "gpu_budget_w")
            .expect("gpu_budget_w");
        assert_eq!(budget.value, "number");
        assert_eq!(budget.unit, Some("W"));
        assert!(budget.required);
        assert!(
            budget.doc.contains("Facility GPU power budget"),
            "{budget:?}"
        );
        let ttl = table(&tables, "[controller]")
            .keys
            .iter()
            .find(|k| k.name == "lease_ttl_s")
            .expect("lease_ttl_s");
        assert_eq!(
            (ttl.value.as_str(), ttl.unit, ttl.required),
            ("integer", Some("s"), false)
        );
        let caps = table(&tables, "[gpu_models.<NAME>]")
            .keys
            .iter()
            .find(|k| k.name == "calibration_caps_w")
            .expect("calibration_caps_w");
        assert_eq!(caps.value, "array of numbers");
    }

    #[test]
    fn every_key_of_the_annotated_example_is_in_the_reference_and_back() {
        // The example sets every key to show it: each of its keys must be documented, and
        // each documented key must be accepted by the loader (a key of the reference that
        // the parser refuses would be documentation for nothing).
        let example = include_str!("../../slurm-conf/powerflex.toml");
        let value: toml::Table = example.parse().expect("the example parses");
        let tables = site_config_tables();
        let mut documented = std::collections::BTreeSet::new();
        for t in &tables {
            for k in &t.keys {
                let prefix = t
                    .heading
                    .trim_matches(|c| c == '[' || c == ']')
                    .replace(".<NAME>", ".*");
                documented.insert(if prefix.is_empty() {
                    k.name.clone()
                } else {
                    format!("{prefix}.{}", k.name)
                });
            }
        }
        let mut in_example = std::collections::BTreeSet::new();
        collect_keys(&value, "", &mut in_example);
        let undocumented: Vec<_> = in_example.difference(&documented).collect();
        assert!(
            undocumented.is_empty(),
            "keys of the example missing from the reference: {undocumented:?}"
        );
        let unshown: Vec<_> = documented.difference(&in_example).collect();
        // The example leaves a few optional keys commented out; each must still be a key
        // the loader knows (it is, by construction: the reference is the types).
        for key in &unshown {
            assert!(
                example.contains(key.rsplit('.').next().unwrap_or(key)),
                "{key} is neither set nor mentioned in slurm-conf/powerflex.toml"
            );
        }
    }

    fn collect_keys(
        table: &toml::Table,
        prefix: &str,
        out: &mut std::collections::BTreeSet<String>,
    ) {
        for (name, value) in table {
            // Named tables (gpu_models.H200) are documented as gpu_models.<NAME>; tier
            // preempt maps (tiers.preempt.flex3) as one key, tiers.preempt.
            let path = if prefix.is_empty() {
                name.clone()
            } else {
                format!("{prefix}.{name}")
            };
            match value {
                toml::Value::Table(t) if prefix == "gpu_models" => {
                    collect_keys(t, "gpu_models.*", out)
                }
                toml::Value::Table(_) if path == "tiers.preempt" => {
                    out.insert(path);
                }
                toml::Value::Table(t) => collect_keys(t, &path, out),
                toml::Value::Array(items)
                    if items.iter().all(|i| i.is_table()) && !items.is_empty() =>
                {
                    for item in items {
                        if let toml::Value::Table(t) = item {
                            collect_keys(t, &path, out);
                        }
                    }
                }
                _ => {
                    out.insert(path);
                }
            }
        }
    }

    #[test]
    fn the_man_page_is_roff_with_every_table() {
        let tables = site_config_tables();
        let man = render_man(&tables, "0.1.0");
        assert!(
            man.contains(".TH POWERFLEX.TOML 5"),
            "{}",
            &man[..200.min(man.len())]
        );
        for t in tables.iter().filter(|t| !t.heading.is_empty()) {
            assert!(man.contains(&t.heading), "{} missing", t.heading);
        }
        assert!(man.contains("gpu_budget_w"));
    }

    #[test]
    fn the_metrics_reference_lists_every_family_once() {
        let text = render_metrics_markdown();
        for family in powerflex_daemon::prom::catalog::all() {
            let row = format!("| `{}` |", family.name);
            assert_eq!(text.matches(&row).count(), 1, "{}", family.name);
        }
    }

    #[test]
    fn units_come_from_the_key_names() {
        assert_eq!(unit_of("max_ramp_w_per_s"), Some("W/s"));
        assert_eq!(unit_of("other_load_kw"), Some("kW"));
        assert_eq!(unit_of("sample_interval_ms"), Some("ms"));
        assert_eq!(unit_of("listen"), None);
    }
}
