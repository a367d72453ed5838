//! The control socket's migrate request, one serde type: `tsubame migrate`
//! writes it, the VM's process reads it, both through this file.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tsubame_migrate::options::{default_codecs, parse_granularity};
use tsubame_migrate::secure::{Psk, TlsConfig};
use tsubame_migrate::subpage::Detector;
use tsubame_migrate::{Address, GpuOffload, MigrateOptions};

/// `{"cmd":"migrate","to":ADDR, ...}`: every key but `to` may be left out
/// (the option's default applies); unknown keys are refused.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigrateRequest {
    /// Always "migrate".
    pub cmd: String,
    /// tcp:HOST:PORT or unix:PATH.
    pub to: String,
    /// Bytes per second.
    pub max_bandwidth: Option<u64>,
    /// Milliseconds.
    pub downtime_limit_ms: Option<u64>,
    /// 1 to 1000.
    pub max_iterations: Option<u32>,
    /// Fail instead of a long stop-and-copy.
    pub abort_if_not_converged: Option<bool>,
    /// Throttle the guest while it outruns the link.
    pub auto_converge: Option<bool>,
    /// Sub-page bytes (4096: whole pages), or "auto".
    pub granularity: Option<serde_json::Value>,
    /// shadow or hash.
    pub subpage_detect: Option<String>,
    /// A codec list, as `--codec`.
    pub codec: Option<String>,
    /// Connections.
    pub channels: Option<u16>,
    /// Encode threads.
    pub encode_threads: Option<u16>,
    /// Pages per batch.
    pub batch_pages: Option<u64>,
    /// Buffers per stage.
    pub buffers: Option<usize>,
    /// False: the stages in turn.
    pub pipeline: Option<bool>,
    /// MSG_ZEROCOPY sends.
    pub zero_copy: Option<bool>,
    /// cuda:POLICY or emulator.
    pub gpu: Option<String>,
    /// Allow plain TCP to a host that is not this one.
    pub insecure: Option<bool>,
    /// off, auto or after=N.
    pub postcopy: Option<String>,
    /// Seconds a cut post-copy link is retried.
    pub postcopy_timeout_s: Option<u64>,
    /// Send the disk cache's block list ahead (default true).
    pub warm_cache: Option<bool>,
    /// auto, all or none: which cached blocks' contents go too.
    pub warm_data: Option<String>,
    /// A pre-shared key file (a path the VM's process can open).
    pub psk_file: Option<PathBuf>,
    /// This end's TLS certificate.
    pub tls_cert: Option<PathBuf>,
    /// Its private key.
    pub tls_key: Option<PathBuf>,
    /// The CA the peer's certificate must chain to.
    pub tls_ca: Option<PathBuf>,
}

/// Key and certificate files of a migrate request (paths the VM's
/// process can open).
#[derive(Debug, Default)]
pub struct SecurityFiles {
    /// `--psk-file`.
    pub psk: Option<PathBuf>,
    /// `--tls-cert`.
    pub tls_cert: Option<PathBuf>,
    /// `--tls-key`.
    pub tls_key: Option<PathBuf>,
    /// `--tls-ca`.
    pub tls_ca: Option<PathBuf>,
}

impl MigrateRequest {
    /// Parses a request line's JSON; a wrong key or type names the key.
    pub fn parse(request: &serde_json::Value) -> Result<MigrateRequest, String> {
        serde_path_to_error::deserialize(request).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner().to_string();
            if path == "." {
                format!("migrate request: {inner}")
            } else {
                format!("\"{path}\": {inner}")
            }
        })
    }

    /// The request for `options` (what [`MigrateRequest::options`] reads back).
    pub fn new(to: &Address, options: &MigrateOptions, files: &SecurityFiles) -> MigrateRequest {
        MigrateRequest {
            cmd: "migrate".into(),
            to: to.to_string(),
            max_bandwidth: options.max_bandwidth,
            downtime_limit_ms: Some(options.downtime_limit.as_millis() as u64),
            max_iterations: Some(options.max_iterations),
            abort_if_not_converged: Some(options.abort_if_not_converged),
            auto_converge: Some(options.auto_converge),
            granularity: Some(if options.granularity_auto { "auto".into() } else { options.granularity.into() }),
            subpage_detect: Some(
                match options.subpage_detector {
                    Detector::Shadow => "shadow",
                    Detector::Hash => "hash",
                }
                .into(),
            ),
            codec: Some(options.codecs.to_string()),
            channels: Some(options.channels),
            encode_threads: Some(options.encode_threads),
            batch_pages: Some(options.batch_pages),
            buffers: Some(options.buffers),
            pipeline: Some(options.pipeline),
            zero_copy: Some(options.zero_copy),
            gpu: options.gpu.map(|gpu| match gpu {
                GpuOffload::Cuda(wait) => format!("cuda:{wait}"),
                GpuOffload::Emulator => "emulator".to_string(),
            }),
            insecure: Some(options.security.insecure),
            postcopy: Some(options.postcopy.to_string()),
            postcopy_timeout_s: Some(options.postcopy_timeout.as_secs()),
            warm_cache: Some(options.warm_cache),
            warm_data: Some(options.warm_data.to_string()),
            psk_file: files.psk.clone(),
            tls_cert: files.tls_cert.clone(),
            tls_key: files.tls_key.clone(),
            tls_ca: files.tls_ca.clone(),
        }
    }

    /// The destination and the options the request asks for, checked.
    pub fn options(&self) -> Result<(Address, MigrateOptions), String> {
        let to: Address = self.to.parse().map_err(|e: tsubame_migrate::transport::TransportError| e.to_string())?;
        let mut options = MigrateOptions { max_bandwidth: self.max_bandwidth, ..MigrateOptions::default() };
        if let Some(ms) = self.downtime_limit_ms {
            options.downtime_limit = Duration::from_millis(ms);
        }
        if let Some(n) = self.max_iterations {
            if n == 0 || n > 1000 {
                return Err("\"max_iterations\" must be between 1 and 1000".into());
            }
            options.max_iterations = n;
        }
        if let Some(g) = &self.granularity {
            let text = match g {
                serde_json::Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            (options.granularity, options.granularity_auto) =
                parse_granularity(&text).map_err(|e| format!("\"granularity\": {e}"))?;
        }
        if let Some(d) = &self.subpage_detect {
            options.subpage_detector = d.parse()?;
        }
        options.codecs = match &self.codec {
            Some(c) => c.parse().map_err(|e: tsubame_codec::CodecError| e.to_string())?,
            None => default_codecs(self.zero_copy == Some(true), self.gpu.is_some()),
        };
        set(&mut options.channels, self.channels);
        set(&mut options.encode_threads, self.encode_threads);
        set(&mut options.batch_pages, self.batch_pages);
        set(&mut options.buffers, self.buffers);
        set(&mut options.auto_converge, self.auto_converge);
        set(&mut options.pipeline, self.pipeline);
        set(&mut options.zero_copy, self.zero_copy);
        set(&mut options.abort_if_not_converged, self.abort_if_not_converged);
        set(&mut options.security.insecure, self.insecure);
        set(&mut options.warm_cache, self.warm_cache);
        if let Some(mode) = &self.postcopy {
            options.postcopy = mode.parse()?;
        }
        if let Some(mode) = &self.warm_data {
            options.warm_data = mode.parse()?;
        }
        if let Some(seconds) = self.postcopy_timeout_s {
            if seconds == 0 {
                return Err("\"postcopy_timeout_s\" must be at least 1".into());
            }
            options.postcopy_timeout = Duration::from_secs(seconds);
        }
        if let Some(text) = &self.gpu {
            options.gpu = Some(match text.split_once(':') {
                Some(("cuda", wait)) => GpuOffload::Cuda(wait.parse()?),
                None if text == "emulator" => GpuOffload::Emulator,
                _ => return Err(format!("\"gpu\": '{text}' is not cuda:POLICY or emulator")),
            });
        }
        if let Some(path) = &self.psk_file {
            options.security.psk = Some(Psk::read(path).map_err(|e| e.to_string())?);
        }
        match (self.tls_cert.as_deref(), self.tls_key.as_deref(), self.tls_ca.as_deref()) {
            (None, None, None) => {}
            (Some(cert), Some(key), Some(ca)) => {
                options.security.tls = Some(TlsConfig::load(cert, key, ca).map_err(|e| e.to_string())?);
            }
            _ => return Err("\"tls_cert\", \"tls_key\" and \"tls_ca\" go together: give all three or none".into()),
        }
        options.check()?;
        Ok((to, options))
    }
}

/// Overwrites `slot` when the request gave a value.
fn set<T>(slot: &mut T, value: Option<T>) {
    if let Some(v) = value {
        *slot = v;
    }
}

/// A path as the VM's process can open it, whatever its working directory.
pub fn canonical(path: Option<&Path>) -> std::io::Result<Option<PathBuf>> {
    path.map(std::fs::canonicalize).transpose()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn options_round_trip_through_the_request() {
        let to: Address = "tcp:127.0.0.1:4444".parse().unwrap();
        let options = MigrateOptions {
            granularity: 128,
            granularity_auto: false,
            channels: 2,
            auto_converge: true,
            max_bandwidth: Some(125_000_000),
            codecs: "zero,zstd".parse().unwrap(),
            postcopy: tsubame_migrate::PostcopyMode::After(2),
            ..MigrateOptions::default()
        };
        let text = serde_json::to_value(MigrateRequest::new(&to, &options, &SecurityFiles::default())).unwrap();
        let (back_to, back) = MigrateRequest::parse(&text).unwrap().options().unwrap();
        assert_eq!(back_to, to);
        assert_eq!((back.granularity, back.granularity_auto), (128, false));
        assert_eq!(back.channels, 2);
        assert!(back.auto_converge);
        assert_eq!(back.max_bandwidth, Some(125_000_000));
        assert_eq!(back.codecs.to_string(), options.codecs.to_string());
        assert_eq!(back.postcopy, tsubame_migrate::PostcopyMode::After(2));
    }

    #[test]
    fn bad_requests_name_the_key() {
        let err = |v| MigrateRequest::parse(&v).unwrap_err();
        assert!(err(json!({"cmd": "migrate"})).contains("to"), "{}", err(json!({"cmd": "migrate"})));
        let wrong = err(json!({"cmd": "migrate", "to": "unix:/x", "channels": "two"}));
        assert!(wrong.starts_with("\"channels\""), "{wrong}");
        let unknown = err(json!({"cmd": "migrate", "to": "unix:/x", "max_bandwith": 1}));
        assert!(unknown.contains("max_bandwith"), "{unknown}");
        let request = MigrateRequest::parse(&json!({"cmd": "migrate", "to": "unix:/x", "max_iterations": 0})).unwrap();
        assert!(request.options().unwrap_err().contains("max_iterations"));
        let request = MigrateRequest::parse(&json!({"cmd": "migrate", "to": "unix:/x", "granularity": 100})).unwrap();
        assert!(request.options().unwrap_err().starts_with("\"granularity\""));
        let auto = MigrateRequest::parse(&json!({"cmd": "migrate", "to": "unix:/x", "granularity": "auto"})).unwrap();
        assert!(auto.options().unwrap().1.granularity_auto);
    }
}
