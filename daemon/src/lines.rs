//! One bounded line read for every line protocol the daemons speak: a peer that never
//! sends a newline costs at most `limit_bytes` of memory, never more.

use std::io::{BufRead, Read};

use crate::DaemonError;

/// Reads one `\n`-terminated line of at most `limit_bytes` (newline included) from
/// `reader`. `Ok(None)` at end of stream; a last line without newline is returned as is.
/// A longer line is an error ([`DaemonError::LineTooLong`]) and the connection should
/// end: the rest of it is still unread. Bytes that are not UTF-8 are replaced (the line's
/// parser rejects them with a message naming the field).
pub fn read_line(
    reader: &mut impl BufRead,
    limit_bytes: usize,
) -> Result<Option<String>, DaemonError> {
    let mut buf = Vec::new();
    let n = reader
        .take(limit_bytes as u64 + 1)
        .read_until(b'\n', &mut buf)
        .map_err(|source| DaemonError::Io {
            what: "cannot read",
            path: "a line".into(),
            source,
        })?;
    if n == 0 {
        return Ok(None);
    }
    if buf.len() > limit_bytes {
        return Err(DaemonError::LineTooLong { limit_bytes });
    }
    Ok(Some(String::from_utf8_lossy(&buf).into_owned()))
}

impl DaemonError {
    /// Whether this is a read that timed out (a slow or silent peer), as opposed to a
    /// broken stream or a protocol violation.
    pub fn is_timeout(&self) -> bool {
        matches!(self, DaemonError::Io { source, .. }
            if matches!(source.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_lines_up_to_the_bound_and_no_further() {
        let mut input: &[u8] = b"abc\nde\n";
        assert_eq!(
            read_line(&mut input, 4).expect("1").as_deref(),
            Some("abc\n")
        );
        assert_eq!(
            read_line(&mut input, 4).expect("2").as_deref(),
            Some("de\n")
        );
        assert_eq!(read_line(&mut input, 4).expect("eof"), None);

        // Exactly at the limit, newline included: accepted.
        let mut input: &[u8] = b"abc\n";
        assert!(read_line(&mut input, 4).expect("fits").is_some());
        // One byte over: refused, and no more than limit + 1 bytes were consumed.
        let long = b"abcd\nrest\n".to_vec();
        let mut cursor = std::io::Cursor::new(long);
        assert!(matches!(
            read_line(&mut cursor, 4),
            Err(DaemonError::LineTooLong { limit_bytes: 4 })
        ));
        assert_eq!(cursor.position(), 5);
        // A line without newline at end of stream is still a line.
        let mut input: &[u8] = b"tail";
        assert_eq!(
            read_line(&mut input, 4).expect("tail").as_deref(),
            Some("tail")
        );
    }

    #[test]
    fn an_endless_line_costs_the_bound_not_the_stream() {
        let mut endless = std::io::BufReader::new(std::io::repeat(b'x'));
        let err = read_line(&mut endless, 1 << 16).expect_err("too long");
        assert_eq!(err.to_string(), "line exceeds the 65536-byte limit");
    }
}
