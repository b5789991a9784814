//! Plain-text tables for humans: a header, aligned columns, numbers right-aligned.

/// A table under construction.
#[derive(Debug, Default)]
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new<I: IntoIterator<Item = S>, S: Into<String>>(header: I) -> Table {
        Table {
            header: header.into_iter().map(Into::into).collect(),
            rows: Vec::new(),
        }
    }

    pub fn row<I: IntoIterator<Item = S>, S: Into<String>>(&mut self, cells: I) {
        self.rows.push(cells.into_iter().map(Into::into).collect());
    }

    /// Renders with two spaces between columns; cells that parse as numbers (or `-`) are
    /// right-aligned, the rest left-aligned.
    pub fn render(&self) -> String {
        let columns = self.header.len();
        let mut widths: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (i, cell) in row.iter().enumerate().take(columns) {
                widths[i] = widths[i].max(cell.chars().count());
            }
        }
        let mut out = String::new();
        let line = |cells: &[String], out: &mut String| {
            let mut text = String::new();
            for (i, width) in widths.iter().enumerate() {
                let cell = cells.get(i).map(String::as_str).unwrap_or("");
                let numeric = is_numeric(cell);
                let pad = width.saturating_sub(cell.chars().count());
                if i > 0 {
                    text.push_str("  ");
                }
                if numeric {
                    text.push_str(&" ".repeat(pad));
                    text.push_str(cell);
                } else {
                    text.push_str(cell);
                    text.push_str(&" ".repeat(pad));
                }
            }
            out.push_str(text.trim_end());
            out.push('\n');
        };
        line(&self.header, &mut out);
        for row in &self.rows {
            line(row, &mut out);
        }
        out
    }
}

fn is_numeric(cell: &str) -> bool {
    let trimmed = cell.trim_end_matches(['%', 'W', ' ', 'k', 'M']);
    cell == "-" || (!trimmed.is_empty() && trimmed.parse::<f64>().is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligns_text_left_and_numbers_right() {
        let mut t = Table::new(["job", "cap"]);
        t.row(["a", "700 W"]);
        t.row(["long-name", "50 W"]);
        assert_eq!(
            t.render(),
            "job        cap\na          700 W\nlong-name   50 W\n"
        );
    }
}
