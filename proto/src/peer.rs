//! Who is on the other end of a Unix socket (`SO_PEERCRED`): the agent and the controller
//! both decide what a local client may do from its uid.

use std::os::unix::io::AsRawFd;
use std::os::unix::net::UnixStream;

/// A connected peer's process and user.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    pub pid: u32,
    pub uid: u32,
}

/// The credentials of a connected Unix-socket peer, as the kernel recorded them at
/// connect time (they cannot be forged by the peer).
pub fn peer_of(stream: &UnixStream) -> std::io::Result<Peer> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, a ucred we own.
    #[allow(unsafe_code)]
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(Peer {
        pid: cred.pid as u32,
        uid: cred.uid,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_socket_pair_sees_this_process() {
        let (a, _b) = UnixStream::pair().expect("pair");
        let peer = peer_of(&a).expect("peer");
        assert_eq!(peer.pid, std::process::id());
        // SAFETY: getuid has no preconditions.
        #[allow(unsafe_code)]
        let uid = unsafe { libc::getuid() };
        assert_eq!(peer.uid, uid);
    }
}
