//! Why a secure connection could not be set up or used.

/// Why a secure connection could not be set up or used.
#[derive(Debug, thiserror::Error)]
pub enum SecureError {
    /// The connection failed during the handshake.
    #[error("handshake: {0}")]
    Io(#[from] std::io::Error),
    /// The peer speaks plain migration or another protocol.
    #[error("the peer did not start a secure handshake ({0}); give both ends the same --psk-file or --tls-* flags, or --insecure on both for plain TCP")]
    NotSecure(&'static str),
    /// The peer authenticates another way.
    #[error("the peer wants {theirs} and this end uses {ours}: give both ends the same --psk-file, or each its --tls-cert, --tls-key and --tls-ca")]
    ModeMismatch {
        /// This end's mode.
        ours: &'static str,
        /// The peer's.
        theirs: &'static str,
    },
    /// The peer's proof did not verify: it holds another key.
    #[error("the peer failed authentication: it does not hold our pre-shared key")]
    PeerNotAuthenticated,
    /// The peer said our proof did not verify.
    #[error("the peer refused us: we do not hold its pre-shared key")]
    RefusedByPeer,
    /// A pre-shared-key file is unusable.
    #[error("pre-shared key {path}: {reason}")]
    BadKey {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// A certificate, key or CA file is unusable.
    #[error("{flag} {path}: {reason}")]
    BadTlsFile {
        /// The flag that named it.
        flag: &'static str,
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// The peer's certificate does not chain to our CA.
    #[error("the peer's certificate is not signed by --tls-ca")]
    UntrustedCertificate,
    /// The peer sent no certificate.
    #[error("the peer sent no certificate")]
    NoCertificate,
    /// The peer's certificate is unacceptable for another reason.
    #[error("the peer's certificate is not acceptable: {0}")]
    BadPeerCertificate(String),
    /// The peer refused our certificate.
    #[error("the peer refused our certificate{why} (TLS alert {alert})")]
    CertificateRefused {
        /// The alert it sent.
        alert: &'static str,
        /// What the alert means, when it says.
        why: &'static str,
    },
    /// The peer ended the handshake with an alert.
    #[error("the peer ended the TLS handshake with alert {0}")]
    TlsAlert(&'static str),
    /// The peer hung up during the TLS handshake.
    #[error("the peer closed the connection during the TLS handshake")]
    TlsClosed,
    /// Both a pre-shared key and TLS certificates were given.
    #[error("--psk-file and --tls-* exclude each other: choose one")]
    BothModes,
    /// Anything else rustls refused.
    #[error("TLS handshake: {0}")]
    Tls(rustls::Error),
}
