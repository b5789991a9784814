//! The jobs' energy records on their way out of the loop: appended to the accounting log
//! in the state directory first (the record of what happened), then handed to the
//! accounting database's writer where the site has one (see [`super::records_db`]).

use tracing::{error, info, warn};

use powerflex_controller_machine::controller::accounting;
use powerflex_daemon::fsx::JsonLines;
use powerflex_proto::status::AccountingDbView;
use powerflex_proto::usage::JobEnergyRecord;

use super::{accounting_log, records_db, Controller, CtldOptions};

pub(super) struct Journal {
    log: JsonLines,
    db: Option<records_db::RecordsDb>,
    /// The database's view the core was last given.
    shown_db_view: Option<AccountingDbView>,
    /// The newest records, which a core built for a new leadership epoch starts with.
    newest: Vec<JobEnergyRecord>,
}

impl Journal {
    /// Reads the accounting log back, gives `core` the newest records and starts the
    /// database's writer with what the whole log holds (it sends what it lacks).
    pub(super) fn open(options: &CtldOptions, core: &mut Controller) -> Result<Journal, String> {
        let log = accounting_log(&options.state_dir);
        let logged = read_back(&log);
        // The core keeps only the newest records.
        let newest = logged[logged.len().saturating_sub(accounting::LOADED_RECORDS)..].to_vec();
        core.load_records(newest.clone());
        let db = match &options.records_db {
            Some(db) => Some(
                records_db::RecordsDb::spawn(db.clone(), logged)
                    .map_err(|e| format!("cannot start the accounting database writer: {e}"))?,
            ),
            None => None,
        };
        Ok(Journal {
            log,
            db,
            shown_db_view: None,
            newest,
        })
    }

    pub(super) fn newest(&self) -> &[JobEnergyRecord] {
        &self.newest
    }

    /// Appends each record to the log, then hands it to the database. False when any
    /// append failed: nothing may be acknowledged to the agents this step.
    pub(super) fn write(&self, records: Vec<JobEnergyRecord>) -> bool {
        let mut written = true;
        for record in records {
            match serde_json::to_string(&record) {
                Ok(line) => {
                    if let Err(e) = self.log.append(&line) {
                        written = false;
                        error!(job_id = %record.job_id, error = %e, "cannot append a job's energy record");
                    }
                }
                Err(e) => {
                    written = false;
                    error!(job_id = %record.job_id, error = %e, "cannot encode a job's energy record")
                }
            }
            if let Some(db) = &self.db {
                db.send(record);
            }
        }
        written
    }

    /// The database's view when it changed since the core last had it.
    pub(super) fn db_view_changed(&mut self) -> Option<AccountingDbView> {
        let view = self.db.as_ref()?.view();
        if self.shown_db_view.as_ref() == Some(&view) {
            return None;
        }
        self.shown_db_view = Some(view.clone());
        Some(view)
    }

    pub(super) fn stop(self) {
        if let Some(db) = self.db {
            db.stop();
        }
    }
}

/// Every record the log holds, oldest first; an unreadable log answers none.
fn read_back(log: &JsonLines) -> Vec<JobEnergyRecord> {
    match log.read_all() {
        Ok(lines) => {
            let logged: Vec<JobEnergyRecord> = lines
                .iter()
                .filter_map(|l| serde_json::from_str(l).ok())
                .collect();
            if !logged.is_empty() {
                info!(
                    records = logged.len(),
                    "job energy records read back from the accounting log"
                );
            }
            logged
        }
        Err(e) => {
            warn!(error = %e, "cannot read the accounting log back; earlier records are not answered");
            Vec::new()
        }
    }
}
