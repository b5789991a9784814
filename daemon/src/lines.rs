//! One bounded line read for every line protocol the daemons speak: a peer that never
//! sends a newline costs at most `limit_bytes` of memory, never more.

use std::io::{BufRead, Read};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use crate::DaemonError;

/// Reads from a Unix stream until one deadline for all the reads together: each `read`
/// waits at most the time left, and once none is left it fails with `TimedOut`. A peer
/// that trickles a byte at a time cannot hold a connection's thread past the deadline,
/// as it could with a timeout per `read(2)`. Wrap it in a `BufReader` for [`read_line`].
#[derive(Debug)]
pub struct DeadlineReader<'s> {
    stream: &'s UnixStream,
    deadline: Instant,
}

impl<'s> DeadlineReader<'s> {
    /// Reads from `stream` for at most `timeout` from now.
    pub fn new(stream: &'s UnixStream, timeout: Duration) -> DeadlineReader<'s> {
        DeadlineReader {
            stream,
            deadline: Instant::now() + timeout,
        }
    }
}

impl Read for DeadlineReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self
            .deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::TimedOut))?;
        self.stream.set_read_timeout(Some(left))?;
        let mut stream = self.stream;
        stream.read(buf)
    }
}

/// Reads one `\n`-terminated line of at most `limit_bytes` (newline included) from
/// `reader`. `Ok(None)` at end of stream; a last line without newline is returned as is.
/// A longer line is an error ([`DaemonError::LineTooLong`]) and the connection should
/// end: the rest of it is still unread. Bytes that are not UTF-8 are replaced (the line's
/// parser rejects them with a message naming the field).
pub fn read_line(
    reader: &mut impl BufRead,
    limit_bytes: usize,
) -> Result<Option<String>, DaemonError> {
    read_line_resuming(reader, &mut Vec::new(), limit_bytes)
}

/// [`read_line`] for a stream read with a timeout: the bytes of a line cut short by the
/// timeout (or any other error) stay in `partial`, and the next call with the same buffer
/// goes on from them, so a short read timeout never loses part of a line. `partial` is
/// empty again after each whole line (and after a line that is too long).
pub fn read_line_resuming(
    reader: &mut impl BufRead,
    partial: &mut Vec<u8>,
    limit_bytes: usize,
) -> Result<Option<String>, DaemonError> {
    let room = (limit_bytes + 1).saturating_sub(partial.len()) as u64;
    // `read_until` leaves every byte it read in `partial`, on error too.
    let n = reader
        .take(room)
        .read_until(b'\n', partial)
        .map_err(|source| DaemonError::Io {
            what: "cannot read",
            path: "a line".into(),
            source,
        })?;
    if n == 0 && partial.is_empty() {
        return Ok(None);
    }
    if partial.len() > limit_bytes {
        partial.clear();
        return Err(DaemonError::LineTooLong { limit_bytes });
    }
    let line = String::from_utf8_lossy(partial).into_owned();
    partial.clear();
    Ok(Some(line))
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

    /// A reader that gives its chunks one per call and times out between them.
    struct Chunks(Vec<&'static [u8]>);

    impl std::io::Read for Chunks {
        fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
            match self.0.first_mut() {
                None => Ok(0),
                Some([]) => {
                    self.0.remove(0);
                    Err(std::io::ErrorKind::WouldBlock.into())
                }
                Some(chunk) => {
                    let n = chunk.len().min(out.len());
                    out[..n].copy_from_slice(&chunk[..n]);
                    *chunk = &chunk[n..];
                    if chunk.is_empty() {
                        self.0.remove(0);
                    }
                    Ok(n)
                }
            }
        }
    }

    #[test]
    fn a_line_cut_by_a_timeout_goes_on_where_it_stopped() {
        let mut reader = std::io::BufReader::new(Chunks(vec![b"ab", b"", b"c\nd", b"", b"e\n"]));
        let mut partial = Vec::new();
        let first = read_line_resuming(&mut reader, &mut partial, 8).expect_err("timeout");
        assert!(first.is_timeout());
        assert_eq!(partial, b"ab", "kept, not lost");
        let line = read_line_resuming(&mut reader, &mut partial, 8).expect("line");
        assert_eq!(line.as_deref(), Some("abc\n"));
        assert!(read_line_resuming(&mut reader, &mut partial, 8)
            .expect_err("timeout")
            .is_timeout());
        let line = read_line_resuming(&mut reader, &mut partial, 8).expect("line");
        assert_eq!(line.as_deref(), Some("de\n"));
        assert_eq!(
            read_line_resuming(&mut reader, &mut partial, 8).expect("eof"),
            None
        );
        // The bound counts the bytes kept from before the timeout too.
        let mut reader = std::io::BufReader::new(Chunks(vec![b"abc", b"", b"def\n"]));
        assert!(read_line_resuming(&mut reader, &mut partial, 4).is_err());
        assert!(matches!(
            read_line_resuming(&mut reader, &mut partial, 4),
            Err(DaemonError::LineTooLong { limit_bytes: 4 })
        ));
        assert!(partial.is_empty());
    }

    #[test]
    fn a_trickling_peer_meets_one_deadline_for_the_whole_read() {
        let (mut peer, ours) = UnixStream::pair().expect("socket pair");
        let writer = std::thread::spawn(move || {
            use std::io::Write;
            // A byte every 50 ms, never a newline: each read(2) alone would succeed.
            for _ in 0..20 {
                if peer.write_all(b"x").is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let started = Instant::now();
        let mut reader =
            std::io::BufReader::new(DeadlineReader::new(&ours, Duration::from_millis(300)));
        let e = read_line(&mut reader, 1024).expect_err("no line within the deadline");
        assert!(e.is_timeout(), "{e}");
        // The deadline is 300 ms; the trickle lasts 1 s. Ending well before the trickle
        // does shows the deadline was one for the whole read (slack for a loaded machine).
        let took = started.elapsed();
        assert!(took < Duration::from_millis(800), "{took:?}");
        drop(reader);
        drop(ours);
        let _ = writer.join();
    }
}
