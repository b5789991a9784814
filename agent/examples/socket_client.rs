//! Sends lines to a Unix socket and prints what comes back: the agent tests use it to
//! talk to `powerflexd` as another user (under `setpriv`) or as another job's process.
//!
//! ```text
//! socket_client SOCKET LINE [LINE...]     # each LINE sent with a newline; replies printed
//! ```

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: socket_client SOCKET LINE [LINE...]");
        std::process::exit(2);
    }
    let mut stream = match UnixStream::connect(&args[1]) {
        Ok(s) => s,
        Err(e) => {
            println!("{{\"connect_error\":\"{e}\"}}");
            return;
        }
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(3)));
    for line in &args[2..] {
        let _ = stream.write_all(line.as_bytes());
        let _ = stream.write_all(b"\n");
    }
    let _ = stream.shutdown(std::net::Shutdown::Write);
    for line in BufReader::new(stream).lines() {
        match line {
            Ok(l) => println!("{l}"),
            Err(_) => break,
        }
    }
}
